"""Lower the IR to numba: the CPU backend, as explicit loops over tile elements.

Each tile node becomes loops over its elements with scalar arithmetic inside (numba_plan decides
which nodes get a buffer and which are recomputed inside their consumers' loops). LLVM compiles such
loops quickly and vectorizes them, where numpy-array expressions in numba made it spend minutes
optimising temporaries. Buffers are flat arrays allocated once per chunk of programs; tensors arrive
as addresses (`tensor.data_ptr()`), with shapes and strides in elements. The innermost dimension of
every tensor has stride 1 (the launcher makes other tensors contiguous), which lets LLVM see
contiguous accesses. 16-bit floats are held as fp32 rounded to their precision and stored as their
raw 16-bit words.

The generated module defines `<name>_programs(first, last, grid0, grid1, ...)`, which runs programs
first..last-1 in order, and `<name>_parallel(chunks, grid0, grid1, grid2, ...)`, which splits the
grid into chunks run on numba's threads.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from kilnx.dsl import opdefs
from kilnx.dsl.ir import NUMPY_OF, SMALL_FLOATS, KernelIR, Node, TensorParam
from kilnx.codegen.numba_bounds import always_true, in_bounds, interval
from kilnx.codegen.numba_plan import ALIAS, BUFFER, INLINED, STATEMENT, Plan
from kilnx.codegen.numba_exprs import (NP, STORE_NP, Nest, _bcast, _buffer_dtype, _from_storage,
                                       _linear, _to_storage, convert, wrap)
from kilnx.codegen.source import Namer, const_literal, param_names, py_literal

# fp contraction (a*b+c as one fma) only: no reassociation, so sums keep the reference's order, and
# no finite-math assumptions, since kernels mask with inf and propagate NaN like numpy.
F32_CLOSED = {"add", "sub", "mul", "truediv", "neg", "abs", "maximum", "minimum"}
STACK_BYTES = 256 << 10   # larger tile buffers go on the heap
JIT_FLAGS = "cache=True, nogil=True, boundscheck=False, error_model='numpy', fastmath={'contract'}"


def generate(ir: KernelIR, *, fn_name: str | None = None, header: str = "") -> str:
    return _Gen(ir, fn_name or ir.name).module(header)


class _Gen:
    def __init__(self, ir: KernelIR, fn: str):
        self.ir, self.fn = ir, fn
        self.plan = Plan(ir)
        self.tensors = {p.name: p for p in ir.params + [o[0] for o in ir.outputs] if isinstance(p, TensorParam)}
        scalars = [p.name for p in ir.params if not isinstance(p, TensorParam)]
        reserved = set(param_names(ir)) | {f"{t}_mem" for t in self.tensors} | {f"{s}_val" for s in scalars} | {
            f"{t}_dim{d}" for t, p in self.tensors.items() for d in range(p.ndim)} | {
            "np", "njit", "prange", "range", "_rt", "_p", "_first", "_last", "_chunk", "_chunks", "_total",
            "pid0", "pid1", "pid2", "grid0", "grid1", "grid2", "math"}
        self.namer = Namer(ir, reserved)
        self.buffers: dict[str, tuple[int, str]] = {}
        self.counter = 0
        self.temp_depth: dict[str, int] = {}
        self.nest: Nest | None = None
        self.accesses: list[tuple[str, str]] = []   # (buffer or tensor, index) read while building an expression
        self.constants: dict[str, str] = {}   # "np.float32(2.0)" -> module-level name
        self.assume: set = set()        # checks and masks taken as passing (the unmasked fast path)
        self.candidates: dict = {}      # checks and masks met, with the test that they pass tile-wide

    # --- module -------------------------------------------------------------------------------------
    def module(self, header: str) -> str:
        body = self.block(self.ir.body, 2)
        params = ", ".join(param_names(self.ir))
        lines = ["import math", "import numpy as np", "from numba import njit, prange",
                 "from kilnx.codegen import numba_rt as _rt", "",
                 # numba's disk cache checks only this module's own file, and the helpers get compiled
                 # into it: naming their version here gives a new module (and binary) when they change
                 f"# numba_rt {_RT_HASH}"]
        lines += [f"# {h}" for h in header.splitlines()]
        # constants as typed module globals: numba freezes them, where a call would be typed per use
        lines += [f"{name} = {value}" for value, name in self.constants.items()] + [""]
        lines += [f"@njit({JIT_FLAGS})", f"def {self.fn}_programs(_first, _last, grid0, grid1, {params}):"]
        lines += [f"    {t}_mem = _rt.ptr_{p.dtype}({t}_ptr)" for t, p in self.tensors.items()]
        lines += [f"    {t}_dim{d} = np.int32({t}_shape{d})" for t, p in self.tensors.items() for d in range(p.ndim)]
        lines += [f"    {p.name}_val = {NP[p.dtype]}({p.name})" for p in self.ir.params if not isinstance(p, TensorParam)]
        for name, (size, dtype) in self.buffers.items():
            nbytes = size * NUMPY_OF[dtype]().itemsize
            lines.append(f"    {name} = _rt.stack_{dtype}({size})" if nbytes <= STACK_BYTES
                         else f"    {name} = np.empty({size}, {STORE_NP[dtype]})")
        lines += ["    for _p in range(_first, _last):",
                  "        pid0 = np.int32(_p % grid0)",
                  "        pid1 = np.int32((_p // grid0) % grid1)",
                  "        pid2 = np.int32(_p // (grid0 * grid1))"]
        lines += body or ["        pass"]
        lines += ["", "", "@njit(cache=True, nogil=True, parallel=True)",
                  f"def {self.fn}_parallel(_chunks, grid0, grid1, grid2, {params}):",
                  "    _total = grid0 * grid1 * grid2",
                  "    for _chunk in prange(_chunks):",
                  f"        {self.fn}_programs(_total * _chunk // _chunks, _total * (_chunk + 1) // _chunks, "
                  f"grid0, grid1, {params})"]
        return "\n".join(lines) + "\n"

    def block(self, block, depth: int) -> list[str]:
        out, pad = [], "    " * depth
        for n in block.nodes:
            if id(n) not in self.plan.live or self.plan.kind.get(id(n)) in (INLINED, ALIAS):
                continue
            if n.op == "range":
                nest = self.open([])
                start, stop, step = (self.expr(s, ()) for s in n.srcs)
                loop = f"_r{self.seq(n)}"
                out += [pad + x for x in nest.lines()]
                out.append(f"{pad}for {loop} in range({start}, {stop}, {step}):")
                out.append(f"{pad}    {self.name(n)} = {NP[n.dtype]}({loop})")
                out += self.block(n.arg, depth + 1)
                continue
            out += [pad + line for line in self.stmts(n)]
        return out

    def open(self, loops) -> Nest:
        self.nest = Nest(self, loops)
        return self.nest

    def seq(self, n: Node) -> int:
        return self.plan.seq[id(n)]

    def name(self, n: Node) -> str:
        return self.namer.name(n)

    def buffer(self, n: Node) -> str:
        root = self.plan.storage(n)
        name = self.name(root)
        self.buffers.setdefault(name, (math.prod(root.shape), _buffer_dtype(root.dtype)))
        return name

    def temp_buffer(self, size: int, dtype: str) -> str:
        self.counter += 1
        name = f"_tmp{self.counter}"
        self.buffers[name] = (size, _buffer_dtype(dtype))
        return name

    # --- statements ---------------------------------------------------------------------------------
    def stmts(self, n: Node) -> list[str]:
        """A statement's lines; when its bounds checks and masks can be shown to pass for the whole
        tile by one scalar test (numba_bounds), the nest is emitted twice: unmasked behind the test,
        masked otherwise. Whole tiles are the common case and their loads become plain vector loads."""
        self.assume, self.candidates = set(), {}
        slow = self._stmts(n)
        if not n.shape and n.op != "reduce":
            return slow
        conds = {k: c for k, c in self.candidates.items() if c is not None and c != "True"}
        if not conds:
            return slow
        self.assume = set(conds)
        fast = self._stmts(n)
        self.assume = set()
        test = " & ".join(f"({c})" for c in dict.fromkeys(conds.values()))
        return [f"if {test}:"] + ["    " + x for x in fast] + ["else:"] + ["    " + x for x in slow]

    def scalar_text(self, n: Node) -> str:
        """A scalar node's value as an expression valid before any loop nest (no temps)."""
        if n.op == "const":
            return const_literal(n)
        if n.op == "dim":
            return f"np.int64({n.arg[0]}_shape{n.arg[1]})"
        if n.op == "param":
            return f"{NP[n.dtype]}({n.arg})"
        if n.op == "program_id":
            return f"np.int64(pid{n.arg})"
        return self.name(n)

    def candidate(self, key, condition: str | None) -> bool:
        """Whether the check `key` is assumed to pass in this emission (else it is recorded)."""
        if key in self.assume:
            return True
        self.candidates[key] = condition
        return False

    def _stmts(self, n: Node) -> list[str]:
        op = n.op
        if op in ("store", "atomic_add"):
            return self.store(n)
        if op == "assign":
            return self.assign(n)
        if op == "reduce":
            return self.reduce(n)
        if op == "dot":
            return self.dot(n)
        if not n.shape:
            nest = self.open([])
            nest.pre[0].append(f"{self.name(n)} = {self.expr(n.srcs[0], ()) if op == 'var' else self.value(n, ())}")
            return nest.lines()
        if op == "var":
            return self.fill(self.buffer(n), n.shape, lambda idx: self.expr(n.srcs[0], idx))
        src = n.srcs[0] if n.srcs else None
        if op in ("reshape", "expand") and self.plan.kind_of(src) in (BUFFER, ALIAS):
            # a view of an accumulator that must not see its later updates: copy it (same flat layout)
            srcbuf = self.buffer(src)
            return self.fill(self.buffer(n), (math.prod(n.shape),), lambda idx: f"{srcbuf}[{idx[0]}]")
        return self.fill(self.buffer(n), n.shape, lambda idx: self.value(n, idx))

    def fill(self, buf: str, shape, element) -> list[str]:
        idx, nest = self.loops_over(shape)
        nest.pre[-1].append(f"{buf}[{_linear(idx, shape)}] = {self.to_buffer(buf, element(idx))}")
        return nest.lines()

    def constant(self, literal: str, dtype: str) -> str:
        value = f"{NP[dtype]}({literal})"
        if value not in self.constants:
            self.constants[value] = f"_K{len(self.constants)}"
        return self.constants[value]

    def to_buffer(self, buf: str, e: str) -> str:
        dtype = self.buffers[buf][1]
        return f"np.uint8({e})" if dtype == "bool" else wrap(e, dtype)

    def no_wrap(self, n: Node) -> bool:
        """In the fast path, i32 index arithmetic whose tile-wide range fits in 32 bits stays in 64-bit
        registers without re-truncation: the value is the same, and LLVM then sees consecutive
        lanes as consecutive addresses (sext(trunc(i + c)) hides that; a GEMV ran 5x slower)."""
        iv = interval(n, self.scalar_text)
        return iv is not None and self.candidate(
            ("nowrap", id(n)), f"({iv[0]} >= -2147483648) & ({iv[1]} <= 2147483647)")

    def loops_over(self, shape, extra=()):
        """Index expressions over a tile shape (size-1 dims get index 0 and no loop) and its Nest."""
        idx, loops = [], []
        for d, size in enumerate(shape):
            idx.append("0" if size == 1 else f"_i{d}")
            if size != 1:
                loops.append((f"_i{d}", str(size)))
        return idx, self.open(loops + list(extra))

    def assign(self, n: Node) -> list[str]:
        var, value = n.srcs
        if not var.shape:
            nest = self.open([])
            nest.pre[0].append(f"{self.name(var)} = {self.expr(value, ())}")
            return nest.lines()
        buf = self.buffer(var)
        idx, nest = self.loops_over(var.shape)
        self.accesses = []
        e = self.expr(value, idx)
        here = _linear(idx, var.shape)
        if all(i == here for b, i in self.accesses if b == buf):
            nest.pre[-1].append(f"{buf}[{here}] = {self.to_buffer(buf, e)}")
            return nest.lines()
        # the new value reads the accumulator elsewhere than where it writes: compute it first
        tmp = self.temp_buffer(math.prod(var.shape), var.dtype)
        nest.pre[-1].append(f"{tmp}[{here}] = {self.to_buffer(tmp, e)}")
        return nest.lines() + self.fill(buf, var.shape, lambda i: f"{tmp}[{_linear(i, var.shape)}]")

    def store(self, n: Node) -> list[str]:
        tname = n.arg[0]
        p = self.tensors[tname]
        value = n.srcs[0]
        idx, nest = self.loops_over(n.shape)
        off, mask = self.address(n, idx, 1)
        self.accesses = []
        v = convert(self.expr(value, _bcast(idx, n.shape, value.shape)), value.dtype, n.dtype)
        lines = []
        if any(b == f"{tname}_mem" and i != off for b, i in self.accesses):
            # the value reads the tensor being written at other places: compute all of it first
            tmp = self.temp_buffer(math.prod(n.shape), n.dtype)
            nest.pre[-1].append(f"{tmp}[{_linear(idx, n.shape)}] = {self.to_buffer(tmp, v)}")
            lines = nest.lines()
            idx, nest = self.loops_over(n.shape)
            off, mask = self.address(n, idx, 1)
            v = f"{tmp}[{_linear(idx, n.shape)}]"
            v = f"({v} != 0)" if n.dtype == "bool" else v
        mem = f"{tname}_mem[{off}]"
        if n.op == "store":
            write = f"{mem} = {_to_storage(v, p.dtype)}"
        else:
            write = f"{mem} = {_to_storage(f'{_from_storage(mem, p.dtype)} + {v}', p.dtype)}"
        writes = [write]
        if n.op == "atomic_add" and not n.shape:   # a scalar atomic's old value, for the code after it
            old = self.name(n)
            nest.pre[-1].append(f"{old} = {self.constant('0', n.dtype)}")
            writes = [f"{old} = {_from_storage(mem, p.dtype)}", write]
        nest.pre[-1] += [f"if {mask}:", *[f"    {w}" for w in writes]] if mask != "True" else writes
        return lines + nest.lines()

    def reduce(self, n: Node) -> list[str]:
        kind, axis, keep = n.arg
        src = n.srcs[0]
        R = src.shape[axis]
        out_idx, nest = self.loops_over(n.shape, [("_red", f"1, {R}" if kind != "sum" else str(R))])
        kept = [i for d, i in enumerate(out_idx) if not (keep and d == axis)]
        v = self.expr(src, kept[:axis] + ["_red"] + kept[axis:])
        k = self.seq(n)
        acc, best = f"_acc{k}", f"_arg{k}"
        dt = src.dtype
        target = self.name(n) if not n.shape else f"{self.buffer(n)}[{_linear(out_idx, n.shape)}]"
        outer, body = nest.pre[-2], nest.pre[-1]
        if kind == "sum":
            outer.append(f"{acc} = {self.constant('0', dt)}")
            body.append(f"{acc} = {wrap(f'{acc} + {v}', dt)}")
            nest.post[-2].append(f"{target} = {acc}")
            return nest.lines()
        first = self.expr(src, kept[:axis] + ["0"] + kept[axis:])
        outer.append(f"{acc} = {first}")
        if kind in ("max", "min"):   # NaN wins, as in numpy
            cmp = ">=" if kind == "max" else "<="
            body += [f"if not ({acc} {cmp} {v} or {acc} != {acc}):", f"    {acc} = {v}"]
            nest.post[-2].append(f"{target} = {acc}")
        else:  # argmax / argmin: the first extreme wins; NaN counts as the extreme, as in numpy
            cmp = ">" if kind == "argmax" else "<"
            outer.append(f"{best} = 0")
            body += [f"if {acc} == {acc} and ({v} {cmp} {acc} or {v} != {v}):", f"    {acc} = {v}",
                     f"    {best} = _red"]
            nest.post[-2].append(f"{target} = np.int32({best})")
        return nest.lines()

    def dot(self, n: Node) -> list[str]:
        a, b = n.srcs
        M, K = a.shape
        N = b.shape[1]
        out = self.buffer(n)
        acc = out if n.dtype == "f32" else self.temp_buffer(M * N, "f32")
        self.open([])
        av = self.expr(a, ["_m", "_k"])
        bv = self.expr(b, ["_k", "_n"])
        a_mk = f"_a{self.seq(n)}"
        lines = [f"for _m in range({M}):",
                 f"    for _n in range({N}):", f"        {acc}[_m * {N} + _n] = np.float32(0)",
                 f"    for _k in range({K}):", f"        {a_mk} = np.float32({av})",
                 f"        for _n in range({N}):",
                 f"            {acc}[_m * {N} + _n] += {a_mk} * np.float32({bv})"]
        if acc != out:
            lines += [f"for _m in range({M * N}):", f"    {out}[_m] = {wrap(f'{acc}[_m]', n.dtype)}"]
        return lines

    # --- expressions --------------------------------------------------------------------------------
    def expr(self, n: Node, idx) -> str:
        """Element idx (one index expression per dim of n) of node n, as a scalar expression."""
        idx = list(idx)
        if n.op == "const":
            return self.constant(const_literal(n), n.dtype)
        if n.op == "dim":
            return f"{n.arg[0]}_dim{n.arg[1]}"
        if n.op == "param":
            return f"{n.arg}_val"
        if n.op == "program_id":
            return f"pid{n.arg}"
        kind = self.plan.kind_of(n)
        if kind == STATEMENT or (not n.shape and kind != INLINED):
            return self.name(n)
        if kind in (BUFFER, ALIAS):
            buf = self.buffer(n)
            i = _linear(idx, n.shape)
            self.accesses.append((buf, i))
            return f"({buf}[{i}] != 0)" if n.dtype == "bool" else f"{buf}[{i}]"
        return self.nest.bind(self.value(n, idx))

    def value(self, n: Node, idx) -> str:
        """The element computed from n's sources (as opposed to read from n's buffer)."""
        op, srcs = n.op, n.srcs

        def src(k, index=None):
            s = srcs[k]
            return self.expr(s, _bcast(idx, n.shape, s.shape) if index is None else index)

        if op in opdefs.OPS:
            if op == "invert" and n.dtype == "bool":
                return f"(not {src(0)})"
            e = opdefs.OPS[op].numba(*(src(k) for k in range(len(srcs))))
            if n.dtype == "i32" and op in ("add", "sub", "mul") and self.no_wrap(n):
                return e
            if n.dtype == "f32" and op in F32_CLOSED and all(x.dtype == "f32" for x in srcs):
                return e   # numba keeps float32 op float32 in float32
            return wrap(e, n.dtype)
        if op == "cast":
            return convert(src(0), srcs[0].dtype, n.dtype)
        if op == "bitcast":
            return f"_rt.as_{n.dtype}({wrap(src(0), srcs[0].dtype)})"   # a 32-bit value, as numba types go
        if op == "where":
            if self.candidate(("mask", id(srcs[0])), always_true(srcs[0], self.scalar_text)):
                return src(1)
            return f"({src(1)} if {src(0)} else {src(2)})"
        if op == "arange":
            start = n.arg[0]
            # a loop index (int64) plus a small constant: no i32 wrap can happen
            return f"({idx[0]} + {start})" if start else idx[0]
        if op == "full":
            return self.constant(py_literal(n.arg), n.dtype)
        if op == "broadcast":
            return src(0)
        if op in ("expand", "reshape"):
            keep = iter([i for i, d in zip(idx, n.shape) if d != 1])
            return src(0, [next(keep) if d != 1 else "0" for d in srcs[0].shape])
        if op == "trans":
            return src(0, idx[::-1])
        if op == "permute":   # result axis i is source axis dims[i]
            return src(0, [idx[n.arg.index(d)] for d in range(len(n.arg))])
        if op == "nibbles":   # the last index picks the code: 0 low, 1 high
            if len(srcs) == 1:
                return f"_rt.nibble({src(0, idx[:-1])}, {idx[-1]})"
            return f"_rt.nibble_dequant({src(0, idx[:-1])}, {idx[-1]}, {src(1, idx[:-1])}, {src(2, idx[:-1])})"
        if op == "join":
            return f"({src(0, idx[:-1])} if {idx[-1]} == 0 else {src(1, idx[:-1])})"
        if op == "load":
            return self.load(n, idx)
        raise NotImplementedError(f"no numba lowering for op {op!r}")

    def address(self, n: Node, idx, first: int):
        """(flat offset, mask) expressions of a load/store lane."""
        tname, checks, has_mask = n.arg[:3]
        p = self.tensors[tname]
        offs, conds = [], []
        for d in range(p.ndim):
            s = n.srcs[first + d]
            i = self.expr(s, _bcast(idx, n.shape, s.shape))
            stride = "" if d == p.ndim - 1 else f" * {tname}_stride{d}"
            offs.append(i + stride)   # times an int64 stride (or added to such terms): int64
            if checks[d] and not self.candidate(("check", tname, d, id(s)),
                                                in_bounds(s, f"{tname}_shape{d}", self.scalar_text)):
                conds.append(self.nest.bind(f"(({i} >= 0) & ({i} < {tname}_shape{d}))"))
        if has_mask:
            m = n.srcs[first + p.ndim]
            if not self.candidate(("mask", id(m)), always_true(m, self.scalar_text)):
                conds.append(self.expr(m, _bcast(idx, n.shape, m.shape)))
        off = self.nest.bind("(" + " + ".join(offs) + ")") if offs else "0"
        mask = self.nest.bind("(" + " & ".join(conds) + ")") if conds else "True"
        return off, mask

    def load(self, n: Node, idx) -> str:
        tname, other = n.arg[0], n.arg[3]
        p = self.tensors[tname]
        off, mask = self.address(n, idx, 0)
        self.accesses.append((f"{tname}_mem", off))
        v = _from_storage(f"{tname}_mem[{off}]", p.dtype)
        if mask == "True":
            return v
        o = self.constant(py_literal(other), "f32" if n.dtype in SMALL_FLOATS else n.dtype)
        return f"({v} if {mask} else {o})"


_RT_HASH = hashlib.sha256(Path(__file__).with_name("numba_rt.py").read_bytes()).hexdigest()[:16]
