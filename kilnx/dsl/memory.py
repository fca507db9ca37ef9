"""Memory in the tile language: reading and writing tensors, kernel outputs, L2 prefetch hints and
the grid-dependency sync that orders a kernel after the previous one (PDL)."""

from __future__ import annotations

from .ir import ITEMSIZE, broadcast_shapes, dsl_error, dtype_of, is_float, with_source
from .lang import TensorArg, Value, arange, builder, lift, tensor_param


def _mem_index(t: TensorArg, idx, mask, what):
    if not isinstance(t, TensorArg):
        raise dsl_error(f"kd.{what} needs a tensor argument as its first operand")
    if len(idx) != t.ndim:
        raise dsl_error(f"kd.{what} of a {t.ndim}-d tensor `{t.param.name}` needs {t.ndim} index tiles, "
                        f"got {len(idx)}")
    idx = [lift(i) for i in idx]
    for i in idx:
        if is_float(i.dtype):
            raise dsl_error(f"kd.{what}: indices must be integers, got {i.dtype}")
    srcs = [i.node for i in idx]
    shapes = [i.shape for i in idx]
    if mask is not None:
        mask = lift(mask)
        srcs.append(mask.node)
        shapes.append(mask.shape)
    return srcs, broadcast_shapes(*shapes), mask is not None


def load(t: TensorArg, *idx, mask=None, other=0, check=True, hint: str | None = None) -> Value:
    """Read t[idx...] (indices broadcast to the tile shape). Out-of-bounds lanes (checked against the
    tensor's shape per dim when `check`, a bool or one per dim) and lanes where `mask` is false read
    `other`. `hint` ("stream" = evict first, "keep" = evict last) only affects the GPU."""
    srcs, shape, has_mask = _mem_index(t, idx, mask, "load")
    checks = tuple(check) if isinstance(check, (tuple, list)) else (bool(check),) * t.ndim
    return Value(builder().emit("load", t.dtype, shape, srcs,
                                arg=(t.param.name, checks, has_mask, other, hint, None)))


def load_tile(t: TensorArg, *offsets, shape) -> Value:
    """The box t[o0:o0 + shape[0], o1:o1 + shape[1], ...] as a tile of `shape`; lanes past t's bounds
    read 0. The same values as `kd.load` with arange indices, but it says the read is one dense box,
    which on the GPU becomes a tensor-memory-accelerator (TMA) copy: one instruction moves the box into
    shared memory, with no per-thread addresses or masks, and the loop pipeliner overlaps it with the
    math on the box before it. TMA's rules hold at launch (checked there, with the way out named): t's
    last dim contiguous, its address and other strides multiples of 16 bytes; and here: the box's last
    dim spans a multiple of 16 bytes."""
    if not isinstance(t, TensorArg):
        raise dsl_error("kd.load_tile needs a tensor argument as its first operand")
    shape = tuple(int(s) for s in shape)
    if len(offsets) != t.ndim or len(shape) != t.ndim:
        raise dsl_error(f"kd.load_tile of a {t.ndim}-d tensor `{t.param.name}` needs {t.ndim} offsets and a "
                        f"{t.ndim}-d shape, got {len(offsets)} offsets and shape {shape}")
    if any(s < 1 or s & (s - 1) for s in shape):
        raise dsl_error(f"kd.load_tile: box sizes must be powers of two, got {shape}")
    if shape[-1] * ITEMSIZE[t.dtype] % 16:
        raise dsl_error(f"kd.load_tile: the box's last dim spans {shape[-1] * ITEMSIZE[t.dtype]} bytes of "
                        f"{t.dtype}; TMA needs a multiple of 16")
    offs = [lift(o) for o in offsets]
    for o in offs:
        if o.shape or is_float(o.dtype):
            raise dsl_error("kd.load_tile: offsets are integer scalars (the box's first index per dim)")
    idx = []
    for d, (o, s) in enumerate(zip(offs, shape)):
        i = o + arange(0, s)
        idx.append(i[tuple(slice(None) if e == d else None for e in range(len(shape)))] if len(shape) > 1 else i)
    builder().ir.tile_tensors.add(t.param.name)
    srcs = [i.node for i in idx] + [o.node for o in offs]
    return Value(builder().emit("load", t.dtype, shape, srcs,
                                arg=(t.param.name, (True,) * t.ndim, False, 0, None, shape)))


def store(t: TensorArg, *idx_and_value, mask=None, check=True):
    """Write value (the last operand) to t[idx...]; masked and out-of-bounds lanes are not written."""
    *idx, value = idx_and_value
    srcs, shape, has_mask = _mem_index(t, idx, mask, "store")
    value = lift(value)
    shape = broadcast_shapes(shape, value.shape)
    checks = tuple(check) if isinstance(check, (tuple, list)) else (bool(check),) * t.ndim
    builder().emit("store", t.dtype, shape, (value.node, *srcs), arg=(t.param.name, checks, has_mask))


def atomic_add(t: TensorArg, *idx_and_value, mask=None, check=True, relaxed: bool = False) -> Value:
    """t[idx...] += value, atomically per element; returns what each lane found there before its add
    (masked lanes: 0). On the GPU the add is acquire-release at device scope, so a program that writes
    results, passes kd.barrier() and then adds to a counter publishes those results to any program that
    later reads the counter's new value and then loads them (the "last program finishes" pattern).
    relaxed=True orders nothing: for sums that only later kernels read (a split reduction), where the
    add's result is unused and the GPU can issue it as a fire-and-forget reduction. The numba backend
    returns the old value of scalar atomics only."""
    *idx, value = idx_and_value
    srcs, shape, has_mask = _mem_index(t, idx, mask, "atomic_add")
    value = lift(value)
    checks = tuple(check) if isinstance(check, (tuple, list)) else (bool(check),) * t.ndim
    builder().ir.uses_atomics = True
    return Value(builder().emit("atomic_add", t.dtype, broadcast_shapes(shape, value.shape), (value.node, *srcs),
                                arg=(t.param.name, checks, has_mask, "relaxed" if relaxed else "acq_rel")))


def prefetch(t: TensorArg, *idx):
    """A hint: pull the lines holding t[idx...] into the GPU's L2. It reads nothing into the kernel, so it
    may come before `grid_dependency_sync`: a kernel launched early (PDL) warms its weights while the
    previous kernel still runs. L2 is the GPU's point of coherence, so a line prefetched before another
    kernel writes it is never stale. No effect on other backends, but every index must lie inside t
    (the reference checks): there is no mask, because a masked lane must still name some address, and
    thousands of programs naming the same one made an L2 hot spot (-28% llama-3.1-8b decode, H200);
    clamp indices to the range instead, so spare lanes repeat a line the program asks for anyway."""
    srcs, shape, _ = _mem_index(t, idx, None, "prefetch")
    builder().emit("prefetch", t.dtype, shape, srcs, arg=(t.param.name, (False,) * t.ndim, False))


def grid_dependency_sync():
    """Where the kernel waits for the previous kernel in the stream to finish (and its writes to be
    visible) when launched with PDL. Every Triton kernel has one; by default it is the first statement.
    Placing it explicitly lets only `prefetch` and index arithmetic come before it: the call must be at
    the kernel's top level, once, before any load, store or atomic."""
    b = builder()
    if b.block is not b.ir.body:
        raise dsl_error("kd.grid_dependency_sync() must be at the kernel's top level, not inside a loop")
    for n in b.ir.walk():
        if n.op == "grid_sync":
            raise dsl_error("kd.grid_dependency_sync() is called twice")
        if n.op in ("load", "store", "atomic_add"):
            raise dsl_error(f"kd.grid_dependency_sync() comes after a {n.op} of `{n.arg[0]}` ({with_source(n.loc)}): "
                            "memory written by the previous kernel may not be ready there; only kd.prefetch "
                            "may precede it")
    b.emit("grid_sync", "i32", ())


def launch_dependents():
    """Where the kernel lets the next kernel in the stream be scheduled (PDL): by default at its grid dependency sync,
    so the next kernel's programs take SM slots (and wait there) once every program of this one has started. A
    kernel of one wave starts all of its programs at once: its successor's would then wait through the whole kernel
    (llama-3.2-1b's fused SwiGLU, kernels/swiglu_prep.py, lost 3.8% of decode so). Called later, at the kernel's top
    level and once, the trigger comes there instead. Nothing on other backends."""
    b = builder()
    if b.block is not b.ir.body:
        raise dsl_error("kd.launch_dependents() must be at the kernel's top level, not inside a loop")
    if any(n.op == "launch_deps" for n in b.ir.walk()):
        raise dsl_error("kd.launch_dependents() is called twice")
    b.emit("launch_deps", "i32", ())


def output(shape, dtype, *, name: str = "out", zero: bool = False) -> TensorArg:
    """A tensor the kernel returns, allocated on the host before launch (zeroed if `zero`, e.g. for
    split-K atomics). `shape` entries are ints or runtime sizes (tensor dims and arithmetic on them)."""
    b = builder()
    if any(o[0].name == name for o in b.ir.outputs) or any(p.name == name for p in b.ir.params):
        raise dsl_error(f"output name {name!r} is already used; pass name=")
    shape_nodes = tuple(lift(s).node for s in shape)
    t = tensor_param(name, dtype_of(dtype), len(shape_nodes), output=True)
    b.ir.outputs.append((t.param, shape_nodes, zero))
    return t


def barrier():
    """Every thread of the program reaches this point before any goes on, and the program's global
    writes before it are visible to its reads after it (on the GPU a block-wide barrier; elsewhere a
    program is one thread in order, and this is nothing). For a kernel that reads back what it wrote."""
    builder().emit("barrier", "i32", ())
