"""Lower the IR to a numba function: the CPU backend.

Each program of the grid runs the kernel body with numpy tiles; programs run in parallel (`prange`)
unless the kernel uses atomics, where they run in order. Tensors arrive flattened with their shapes
and strides in elements; bf16 tensors arrive as their raw 16-bit words.
"""

from __future__ import annotations

from kilnx.dsl import opdefs
from kilnx.dsl.ir import NUMPY_OF, DSLError, KernelIR, Node
from kilnx.codegen.source import (Namer, StatementEmitter, const_literal, live_nodes, param_names,
                                  py_literal)

NP = {d: f"np.{t.__name__}" for d, t in NUMPY_OF.items()}


def generate(ir: KernelIR, *, fn_name: str | None = None, header: str = "") -> str:
    g = _Gen(ir)
    fn = fn_name or ir.name
    params = ", ".join(param_names(ir))
    loop = "range" if ir.uses_atomics else "prange"
    lines = ["import numpy as np", "from numba import njit, prange",
             "from kilnx.codegen import numba_rt as _rt", ""]
    if header:
        lines += [f"# {h}" for h in header.splitlines()]
    # One program is a plain jitted function (numpy broadcasting works there); the launcher runs
    # programs in parallel. Parallel array expressions inside prange do not support broadcasting.
    lines += ["@njit(cache=True, nogil=True)", f"def {fn}_program(pid0, pid1, pid2, {params}):"]
    lines += g.block(ir.body, 1) or ["    pass"]
    lines += ["", "", "@njit(parallel=True)  # a parallel launcher cannot be cached (numba holds it in a dynamic global)", f"def {fn}({params}, grid0, grid1, grid2):",
              f"    for _p in {loop}(grid0 * grid1 * grid2):",
              f"        {fn}_program(_p % grid0, (_p // grid0) % grid1, _p // (grid0 * grid1), {params})"]
    return "\n".join(lines) + "\n"


class _Gen(StatementEmitter):
    def __init__(self, ir: KernelIR):
        self.ir = ir
        self.params = {p.name: p for p in ir.params + [o[0] for o in ir.outputs]}
        self.live = live_nodes(ir)
        self.namer = Namer(ir, set(param_names(ir)) | {"np", "njit", "prange", "range", "_rt", "_p",
                                                      "pid0", "pid1", "pid2", "grid0", "grid1", "grid2"})

    def ref(self, n: Node) -> str:
        if n.op == "const":
            return f"{NP[n.dtype]}({const_literal(n)})"
        if n.op == "dim":
            return f"{n.arg[0]}_shape{n.arg[1]}"
        if n.op == "param":
            return f"{NP[n.dtype]}({n.arg})"
        if n.op == "program_id":
            return f"np.int32(pid{n.arg})"
        return self.namer.name(n)

    def _fill(self, expr: str, n: Node, dtype: str) -> str:
        """Broadcast an expression to the node's tile shape (numba needs explicit shapes)."""
        if not n.shape:
            return expr
        return f"(({expr}) + np.zeros({tuple(n.shape)}, {NP[dtype]}))"

    def stmts(self, n: Node) -> list[str]:
        r = [self.ref(s) for s in n.srcs]
        name, op = self.ref(n), n.op
        if op in opdefs.OPS:
            e = opdefs.OPS[op].numba(*r)
            if n.dtype in ("f16", "bf16"):
                e = f"_rt.round_{'bf16' if n.dtype == 'bf16' else 'f16'}({e})"
            elif n.dtype != "bool":
                e = f"{NP[n.dtype]}({e})" if not n.shape else f"({e}).astype({NP[n.dtype]})"
            return [f"{name} = {e}"]
        if op == "arange":
            return [f"{name} = np.arange({n.arg[0]}, {n.arg[1]}).astype(np.int32)"]
        if op == "full":
            return [f"{name} = np.full({tuple(n.shape)}, {py_literal(n.arg)}, {NP[n.dtype]})" if n.shape
                    else f"{name} = {NP[n.dtype]}({py_literal(n.arg)})"]
        if op == "cast":
            if n.dtype in ("f16", "bf16"):
                e = f"_rt.round_{n.dtype}({r[0]})"
                return [f"{name} = {e}" if n.shape else f"{name} = {e}.item()"]
            if not n.shape:
                return [f"{name} = {NP[n.dtype]}({r[0]})"]
            return [f"{name} = np.asarray({r[0]}).astype({NP[n.dtype]})"]
        if op == "bitcast":
            return [f"{name} = np.ascontiguousarray({r[0]}).view({NP[n.dtype]})"]
        if op == "var":
            return [f"{name} = {r[0]}" if not n.shape else f"{name} = {r[0]}.copy()"]
        if op == "assign":
            return [f"{r[0]} = {r[1]}"]
        if op == "where":
            if not n.shape:
                return [f"{name} = {r[1]} if {r[0]} else {r[2]}"]
            c = f"(({r[0]}) & np.ones({tuple(n.shape)}, np.bool_))"
            return [f"{name} = np.where({c}, {self._fill(r[1], n, n.dtype)}, {self._fill(r[2], n, n.dtype)})"]
        if op == "reduce":
            return [self.reduce(n, name, r[0])]
        if op in ("expand", "reshape"):
            return [f"{name} = np.ascontiguousarray({r[0]}).reshape({tuple(n.shape)})"]
        if op == "broadcast":
            return [f"{name} = {self._fill(r[0], n, n.dtype)}"]
        if op == "trans":
            return [f"{name} = np.ascontiguousarray({r[0]}.T)"]
        if op == "dot":
            return [f"{name} = _rt.matmul(np.ascontiguousarray({r[0]}).astype(np.float32), "
                    f"np.ascontiguousarray({r[1]}).astype(np.float32)).astype({NP[n.dtype]})"]
        if op == "load":
            return self.load(n, name, r)
        if op in ("store", "atomic_add"):
            return self.store(n, r)
        raise NotImplementedError(f"no numba lowering for op {op!r}")

    def reduce(self, n: Node, name: str, x: str) -> str:
        kind, axis, keep = n.arg
        src = n.srcs[0]
        if len(src.shape) > 2:
            raise DSLError(f"the numba backend reduces 1-d and 2-d tiles only (got {list(src.shape)})\n  at {n.loc}")
        if kind in ("argmax", "argmin"):
            sign = "1.0" if kind == "argmax" else "-1.0"
            e = (f"_rt.argmax1(np.ascontiguousarray({x}), {sign})" if len(src.shape) == 1
                 else f"_rt.argmax2(np.ascontiguousarray({x}), {sign}, {axis})")
        else:
            k = {"sum": 0, "max": 1, "min": 2}[kind]
            e = (f"_rt.reduce1(np.ascontiguousarray({x}), {k})" if len(src.shape) == 1
                 else f"_rt.reduce2(np.ascontiguousarray({x}), {k}, {axis})")
        if keep:
            e = f"np.asarray({e}).reshape({tuple(n.shape)})"
        elif not n.shape:
            e = f"{NP[n.dtype]}({e})"
        return f"{name} = {e}"

    def address(self, n: Node, r: list[str], first: int):
        tname, checks, has_mask = n.arg[:3]
        idx = r[first:first + len(checks)]
        nodes = n.srcs[first:first + len(checks)]
        off = " + ".join((f"np.asarray({i}).astype(np.int64)" if nd.shape else f"np.int64({i})")
                         + f" * {tname}_stride{d}" for d, (i, nd) in enumerate(zip(idx, nodes)))
        conds = [f"({i} < {tname}_shape{d})" for d, (i, c) in enumerate(zip(idx, checks)) if c]
        if has_mask:
            conds.append(f"({r[first + len(checks)]})")
        mask = " & ".join(conds) if conds else "True"
        return off, mask

    def load(self, n: Node, name: str, r) -> list[str]:
        tname, other = n.arg[0], n.arg[3]
        off, mask = self.address(n, r, 0)
        p = self.params[tname]
        if not n.shape:
            if p.dtype == "bf16":
                get = f"_rt.bf16_bits_to_f32(np.array([{tname}_ptr[{off}]]))[0]"
            else:
                get = f"{tname}_ptr[{off}]"
            return [f"{name} = {NP[n.dtype]}({get}) if ({mask}) else {NP[n.dtype]}({py_literal(other)})"]
        shape = tuple(n.shape)
        o = f"(({off}) + np.zeros({shape}, np.int64))"
        m = f"(({mask}) & np.ones({shape}, np.bool_))"
        fn = "_rt.gather_bf16" if p.dtype == "bf16" else "_rt.gather"
        oth = f"np.uint16(0)" if False else f"{NP[p.dtype] if p.dtype != 'bf16' else 'np.float32'}({py_literal(other)})"
        e = f"{fn}({tname}_ptr, {o}, {m}, {oth})"
        if p.dtype == "f16":
            e = f"{e}.astype(np.float32)"
        return [f"{name} = {e}"]

    def store(self, n: Node, r) -> list[str]:
        tname = n.arg[0]
        off, mask = self.address(n, r, 1)
        p = self.params[tname]
        shape = tuple(n.shape) if n.shape else (1,)
        o = f"(({off}) + np.zeros({shape}, np.int64))"
        m = f"(({mask}) & np.ones({shape}, np.bool_))"
        store_t = "np.float16" if p.dtype == "f16" else ("np.float32" if p.dtype == "bf16" else NP[p.dtype])
        v = f"(({r[0]}) + np.zeros({shape}, {store_t})).astype({store_t})"
        fn = {"store": "_rt.scatter", "atomic_add": "_rt.scatter_add"}[n.op]
        if p.dtype == "bf16":
            fn += "_bf16"
        return [f"{fn}({tname}_ptr, {o}, {m}, {v})"]
