"""The numpy interpretation of the IR: the specification every backend is tested against.

Programs run one after another; each node is evaluated in program order with numpy. 16-bit floats
are held in fp32 arrays rounded to their precision. An out-of-bounds access on a dimension the kernel
declared unchecked is an error here (on the GPU it would read garbage).
"""

from __future__ import annotations

import itertools

import numpy as np

from kilnx.dsl import opdefs
from kilnx.dsl.ir import NUMPY_OF, SMALL_FLOATS, DSLError, KernelIR, Node, with_source


def round_to(x, dtype: str):
    """Round fp32 values to a narrow float's precision (kept in fp32), as a store or cast would. fp8 e4m3:
    to nearest even, saturating at +-448 (e4m3fn has no infinity), NaN kept (torch's and sm_90's conversion)."""
    if dtype == "f8e4":
        from kilnx.quant.float_codecs import e4m3_decode, e4m3_encode
        a = np.asarray(x, np.float32)
        return np.where(np.isnan(a), a, e4m3_decode(e4m3_encode(a))).astype(np.float32)
    if dtype == "f16":
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        a = np.ascontiguousarray(np.asarray(x, np.float32))
        bits = a.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
        nan = np.isnan(a)
        out = rounded.view(np.float32)
        return np.where(nan, a, out).astype(np.float32).reshape(a.shape)
    return x


def cast(x, dtype: str):
    if dtype in SMALL_FLOATS:
        return round_to(np.asarray(x, np.float32), dtype)
    return np.asarray(x).astype(NUMPY_OF[dtype])


class Interpreter:
    def __init__(self, ir: KernelIR, arrays: dict[str, np.ndarray], scalars: dict):
        self.ir, self.arrays, self.scalars = ir, arrays, scalars

    def eval_host(self, node: Node):
        """Evaluate a scalar expression on the host (grid sizes, output shapes)."""
        env: dict = {}
        order = []

        def visit(n):
            if id(n) in env or not isinstance(n, Node):
                return
            for s in n.srcs:
                visit(s)
            order.append(n)
            env[id(n)] = None
        visit(node)
        env = {}
        for n in order:
            env[id(n)] = self.eval(n, env, pid=(0, 0, 0))
        return int(env[id(node)])

    def run(self, grid: tuple[int, ...]):
        for pid in itertools.product(*(range(g) for g in grid)):
            env: dict = {}
            self.exec_block(self.ir.body, env, pid + (0,) * (3 - len(pid)))

    def exec_block(self, block, env, pid):
        for n in block.nodes:
            if n.op == "range":
                start, stop, step = (int(env[id(s)]) for s in n.srcs)
                for i in range(start, stop, step):
                    env[id(n)] = NUMPY_OF[n.dtype](i)
                    self.exec_block(n.arg, env, pid)
            else:
                env[id(n)] = self.eval(n, env, pid)

    def eval(self, n: Node, env, pid):
        v = [env[id(s)] for s in n.srcs]
        op = n.op
        if op in opdefs.OPS:
            out = opdefs.OPS[op].reference(*v)
            if n.dtype in SMALL_FLOATS:
                out = round_to(out, n.dtype)
            return np.asarray(out).astype(NUMPY_OF[n.dtype])
        if op == "const":
            return NUMPY_OF[n.dtype](n.arg)
        if op == "param":
            return NUMPY_OF[n.dtype](self.scalars[n.arg])
        if op == "dim":
            name, axis = n.arg
            return np.int32(self.arrays[name].shape[axis])
        if op == "program_id":
            return np.int32(pid[n.arg])
        if op == "arange":
            return np.arange(*n.arg, dtype=np.int32)
        if op == "full":
            return cast(np.full(n.shape, n.arg, dtype=np.float64), n.dtype)
        if op == "cast":
            return cast(v[0], n.dtype)
        if op == "bitcast":
            return np.ascontiguousarray(v[0]).view(NUMPY_OF[n.dtype])
        if op in ("var", "assign"):
            if op == "assign":
                env[id(n.srcs[0])] = v[1]
                return v[1]
            return np.array(v[0], copy=True)
        if op == "where":
            return np.where(v[0], v[1], v[2]).astype(NUMPY_OF[n.dtype])
        if op == "reduce":
            kind, axis, keep = n.arg
            return np.asarray(opdefs.reduce_reference(kind, v[0], axis, keep))
        if op == "expand":
            return np.asarray(v[0]).reshape(n.shape)
        if op == "reshape":
            return np.asarray(v[0]).reshape(n.shape)
        if op == "broadcast":
            return np.broadcast_to(v[0], n.shape).copy()
        if op == "trans":
            return np.ascontiguousarray(np.asarray(v[0]).T)
        if op == "permute":
            return np.ascontiguousarray(np.transpose(np.asarray(v[0]), n.arg))
        if op == "nibbles":
            return opdefs.nibbles_reference(*v)
        if op == "join":
            return np.stack([np.asarray(v[0]), np.asarray(v[1])], axis=-1)
        if op == "dot":
            a, b = v
            return (a.astype(np.float32) @ b.astype(np.float32)).astype(NUMPY_OF[n.dtype])
        if op == "load":
            return self.load(n, v)
        if op == "prefetch":   # a hint, but its indices must lie inside the tensor: checked here
            self._lanes(n, v, 0)
            return None
        if op in ("grid_sync", "barrier", "launch_deps"):   # launch and block ordering: a program here runs in order
            return None
        if op in ("store", "atomic_add"):
            return self.store(n, v)
        raise DSLError(f"the reference interpreter has no rule for op {op!r}")

    def _lanes(self, n: Node, v, first_idx: int):
        name, checks, has_mask = n.arg[:3]
        arr = self.arrays[name]
        nd = arr.ndim
        idx = [np.broadcast_to(np.asarray(i, np.int64), n.shape) for i in v[first_idx:first_idx + nd]]
        mask = np.ones(n.shape, bool)
        if has_mask:
            mask &= np.broadcast_to(v[first_idx + nd], n.shape)
        for d, (i, chk) in enumerate(zip(idx, checks)):
            inb = (i >= 0) & (i < arr.shape[d])
            if chk:
                mask &= inb
            elif not np.all(inb | ~mask):
                raise DSLError(f"out-of-bounds access to `{name}` on unchecked dim {d} "
                               f"(index range {int(i.min())}..{int(i.max())}, size {arr.shape[d]})\n  at {with_source(n.loc)}")
        return arr, idx, mask

    @staticmethod
    def _read(n: Node, arr, idx, mask, other):
        """arr at every lane's index, `other` where the mask is off (indices clipped: masked lanes may
        name any address)."""
        clipped = tuple(np.clip(i, 0, max(s - 1, 0)) for i, s in zip(idx, arr.shape))
        vals = arr[clipped] if arr.size else np.zeros(n.shape, arr.dtype)
        return np.where(mask, vals, other).astype(NUMPY_OF[n.dtype])

    def load(self, n: Node, v):
        arr, idx, mask = self._lanes(n, v, 0)
        return self._read(n, arr, idx, mask, n.arg[3])

    def store(self, n: Node, v):
        value = v[0]
        arr, idx, mask = self._lanes(n, v, 1)
        value = cast(np.broadcast_to(value, n.shape), n.dtype)
        sel = tuple(i[mask] for i in idx)
        if n.op == "store":
            arr[sel] = value[mask]
            return None
        old = self._read(n, arr, idx, mask, 0)
        np.add.at(arr, sel, value[mask])
        if n.dtype in SMALL_FLOATS:
            arr[sel] = round_to(arr[sel], n.dtype)
        return old
