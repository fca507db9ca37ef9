"""Lower the IR to Triton source: one statement per node, the author's names kept.

The source is version-independent (plain `tl.*` calls present in Triton 3.2 and later, and kilnx's
`_rt` helpers for what has no `tl.*` spelling), so golden files hold across the GPU's and CI's Triton
versions. `interpret=True` upcasts dot operands to fp32,
because the Triton interpreter mis-computes 16-bit dots.
"""

from __future__ import annotations

from kilnx.dsl import opdefs
from kilnx.dsl.ir import KernelIR, Node
from kilnx.codegen.source import (Namer, StatementEmitter, const_literal, live_nodes, param_names,
                                  py_literal)

TL = {"f8e4": "tl.float8e4nv", "f16": "tl.float16", "bf16": "tl.bfloat16", "f32": "tl.float32", "f64": "tl.float64",
      "i8": "tl.int8", "u8": "tl.uint8", "i16": "tl.int16", "i32": "tl.int32", "u32": "tl.uint32",
      "i64": "tl.int64", "bool": "tl.int1"}
HINTS = {"stream": "evict_first", "keep": "evict_last"}


def generate(ir: KernelIR, *, fn_name: str | None = None, interpret: bool = False, header: str = "") -> str:
    g = _Gen(ir, interpret)
    fn = fn_name or ir.name
    lines = ["import triton", "import triton.language as tl", "", ""]
    if header:
        lines += [f"# {h}" for h in header.splitlines()]
    lines += ["@triton.jit", f"def {fn}({', '.join(param_names(ir))}):"]
    # first, before any memory access: the kernel may be scheduled before the previous one finished
    # (unless the author placed it, after prefetches: kd.grid_dependency_sync checks the order)
    explicit = any(n.op == "grid_sync" for n in ir.walk())
    lines += ([] if explicit else [f"    _rt.{g.sync}()"]) + g.descriptors() + g.block(ir.body, 1)
    lines.insert(2, "from kilnx.codegen import triton_rt as _rt")
    return "\n".join(lines) + "\n"


class _Gen(StatementEmitter):
    def __init__(self, ir: KernelIR, interpret: bool):
        self.ir, self.interpret = ir, interpret
        self.live = live_nodes(ir, hints=True, boxes=True)
        # the sync waits, and also triggers the next kernel unless the author placed the trigger (kd.launch_dependents)
        self.sync = ("grid_dependency_wait" if any(n.op == "launch_deps" for n in ir.walk())
                     else "grid_dependency_sync")
        self.namer = Namer(ir, set(param_names(ir)) | {"tl", "triton", "range", "_rt"})

    def ref(self, n: Node) -> str:
        if n.op == "const":
            return const_literal(n)
        if n.op == "dim":
            return f"{n.arg[0]}_shape{n.arg[1]}"
        if n.op == "param":
            return n.arg
        if n.op == "program_id":
            return f"tl.program_id({n.arg})"
        return self.namer.name(n)

    def loop_header(self, n: Node, bounds: str) -> str:
        # an explicit num_stages is what makes Triton pipeline loads that no dot consumes
        opts = ([f"num_stages={n.arg.stages}"] if n.arg.stages is not None else []) + \
            (["flatten=True"] if n.arg.flatten and not self.interpret else [])
        return f"tl.range({bounds}, {', '.join(opts)})" if opts else super().loop_header(n, bounds)

    def stmts(self, n: Node) -> list[str]:
        stmt = self.stmt(n)
        return [stmt] if stmt else []

    def stmt(self, n: Node) -> str:
        r = [self.ref(s) for s in n.srcs]
        name = self.ref(n)
        op = n.op
        if op in opdefs.OPS:
            if self.interpret and n.shape and any(s.dtype == "bool" and not s.shape for s in n.srcs):
                # the interpreter's tile & scalar-bool gives a dtype its loads reject as a mask: broadcast first
                r = [f"((tl.zeros({list(n.shape)}, tl.int32) + {x}) != 0)" if s.dtype == "bool" and not s.shape
                     else x for s, x in zip(n.srcs, r)]
            return f"{name} = {opdefs.OPS[op].triton(*r)}"
        if op == "arange":
            return f"{name} = tl.arange({n.arg[0]}, {n.arg[1]})"
        if op == "full":
            return f"{name} = tl.full({list(n.shape)}, {py_literal(n.arg)}, {TL[n.dtype]})"
        if op == "cast":
            src = n.srcs[0]
            if src.op == "const":
                lit = float(src.arg) if n.dtype.startswith("f") else int(src.arg)
                return f"{name} = tl.full([], {lit!r}, {TL[n.dtype]})"
            if src.op in ("dim", "param"):
                # Triton specializes int arguments equal to 1 into constexprs, which have no .to()
                return f"{name} = tl.cast({r[0]}, {TL[n.dtype]})"
            return f"{name} = {self.converted(r[0], src.dtype, n.dtype)}"
        if op == "bitcast":
            return f"{name} = {r[0]}.to({TL[n.dtype]}, bitcast=True)"
        if op == "var":
            return f"{name} = {r[0]}"
        if op == "assign":
            return f"{r[0]} = {r[1]}"
        if op == "where":
            return f"{name} = tl.where({r[0]}, {r[1]}, {r[2]})"
        if op == "reduce":
            kind, axis, keep = n.arg
            fn = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min", "argmax": "tl.argmax",
                  "argmin": "tl.argmin"}[kind]
            extra = ", tie_break_left=True" if kind in ("argmax", "argmin") else ""
            return f"{name} = {fn}({r[0]}, axis={axis}, keep_dims={keep}{extra})"
        if op == "expand":
            idx = ", ".join("None" if e else ":" for e in n.arg)
            return f"{name} = {r[0]}[{idx}]"
        if op == "reshape":
            return f"{name} = tl.reshape({r[0]}, {list(n.shape)})"
        if op == "broadcast":
            return f"{name} = tl.broadcast_to({r[0]}, {list(n.shape)})"
        if op == "join":
            return f"{name} = tl.join({r[0]}, {r[1]})"
        if op == "trans":
            return f"{name} = tl.trans({r[0]})"
        if op == "permute":
            return f"{name} = tl.permute({r[0]}, {tuple(n.arg)})"
        if op == "nibbles":
            call = "_rt.nibbles" if len(r) == 1 else "_rt.nibbles_dequant"
            return f"{name} = {call}({', '.join(r)})"
        if op == "dot":
            a, b = n.srcs
            if min(a.shape[0], a.shape[1], b.shape[1]) >= 16:
                if self.interpret:
                    return f"{name} = tl.dot({r[0]}.to(tl.float32), {r[1]}.to(tl.float32))"
                return f"{name} = tl.dot({r[0]}, {r[1]})"
            return (f"{name} = tl.sum({r[0]}.to(tl.float32)[:, :, None] * "
                    f"{r[1]}.to(tl.float32)[None, :, :], axis=1)")
        if op == "load" and n.arg[5] is not None:   # kd.load_tile: a box read through a TMA descriptor
            ndim = len(n.arg[5])
            return f"{name} = {self.descriptor_name(n)}.load([{', '.join(r[ndim:2 * ndim])}])"
        if op == "load":
            ptr, mask = self.address(n, r, 0)
            tname, _, _, other, hint, _ = n.arg
            args = [ptr]
            if mask:
                if n.dtype == "f8e4":   # an integer `other` has no cast to fp8 (the interpreter refuses one)
                    other = float(other)
                args += [f"mask={mask}", f"other={py_literal(other)}"]
            if hint in HINTS:
                args.append(f"eviction_policy='{HINTS[hint]}'")
            return f"{name} = tl.load({', '.join(args)})"
        if op == "grid_sync":
            return f"_rt.{self.sync}()"
        if op == "launch_deps":
            return "_rt.launch_dependents()"
        if op == "barrier":
            return "tl.debug_barrier()"
        if op == "prefetch":   # indices in bounds by contract (kd.prefetch): no mask
            return f"_rt.prefetch_l2({self.address(n, r, 0)[0]})"
        if op in ("store", "atomic_add"):
            ptr, mask = self.address(n, r, 1)
            val = self.converted(r[0], n.srcs[0].dtype, n.dtype) if n.srcs[0].dtype != n.dtype else r[0]
            if n.srcs[0].op == "const":
                val = r[0]
            m = f", mask={mask}" if mask else ""
            if op == "atomic_add":   # acquire-release at GPU scope unless asked relaxed (kd.atomic_add's contract)
                return f"{name} = tl.atomic_add({ptr}, {val}{m}, sem='{n.arg[3]}', scope='gpu')"
            return f"tl.store({ptr}, {val}{m})"
        raise NotImplementedError(f"no Triton lowering for op {op!r}")

    def converted(self, expr: str, src: str, dst: str) -> str:
        """`expr` of dtype src as dst; fp8 through exact helpers under the interpreter (triton_rt.to_f8e4)."""
        if self.interpret and dst == "f8e4":
            return f"_rt.to_f8e4({expr})"
        if self.interpret and src == "f8e4":
            return f"_rt.f8e4_to_f32({expr}).to({TL[dst]})"
        if dst == "f8e4" and src != "f32":   # through fp32 (exact from 16 bits): not every Triton casts bf16 -> fp8
            return f"{expr}.to(tl.float32).to({TL[dst]})"
        return f"{expr}.to({TL[dst]})"

    @staticmethod
    def descriptor_name(n: Node) -> str:
        return f"{n.arg[0]}_box{'x'.join(map(str, n.arg[5]))}"

    def descriptors(self) -> list[str]:
        """One TMA descriptor per (tensor, box shape) that kd.load_tile reads, made once at the kernel's top
        (making one is a write of 128 bytes to global scratch and a fence: not a thing to do per loop trip).
        The launcher checks the TMA rules (last stride 1, 16-byte address and strides) before launch."""
        out, seen = [], set()
        for n in self.ir.walk():
            if n.op != "load" or n.arg[5] is None or self.descriptor_name(n) in seen:
                continue
            seen.add(self.descriptor_name(n))
            t, box = n.arg[0], n.arg[5]
            shape = ", ".join(f"{t}_shape{d}" for d in range(len(box)))
            strides = ", ".join([f"{t}_stride{d}" for d in range(len(box) - 1)] + ["1"])
            out.append(f"    {self.descriptor_name(n)} = tl.make_tensor_descriptor({t}_ptr, shape=[{shape}], "
                       f"strides=[{strides}], block_shape={list(box)})")
        return out

    def address(self, n: Node, r: list[str], first: int):
        tname, checks, has_mask = n.arg[:3]
        ndim = len(checks)
        idx = r[first:first + ndim]
        offs = " + ".join(f"{i} * {tname}_stride{d}" for d, i in enumerate(idx))
        nodes = n.srcs[first:first + ndim + (1 if has_mask else 0)]
        terms = [(f"{i}", nd, f" < {tname}_shape{d}") for d, (i, nd, c) in enumerate(zip(idx, nodes, checks)) if c]
        if has_mask:
            terms.append((r[first + ndim], nodes[-1], ""))
        masks = []
        for expr, nd, cmp in terms:
            if self.interpret and n.shape and not nd.shape:
                # the interpreter rejects scalar/tile mixes in masks: broadcast the scalar first
                expr = f"(tl.zeros({list(n.shape)}, tl.int32) + {expr})"
                if not cmp:   # a scalar mask: back to bool after the broadcast
                    cmp = " != 0"
            masks.append(f"({expr}{cmp})")
        if self.interpret and not n.shape and masks:
            # nor does it take a Python bool (a scalar access's bounds check on sizes alone) as a mask
            masks.insert(0, "tl.full([], True, tl.int1)")
        return f"{tname}_ptr + {offs}", " & ".join(masks)
