"""The tile-level language: traced Python that records IR nodes.

Inside a `@kd.kernel` function, tensor arguments are `TensorArg`s and everything computed from them
is a `Value` wrapping an IR node. Tunables and `kd.constexpr` arguments are plain Python values, so
Python `if`/`for` over them is ordinary specialization; Python `if` on a traced value is an error.
"""

from __future__ import annotations

import builtins
import threading
from typing import Any

from . import opdefs
from .ir import (Block, DSLError, KernelIR, Node, ScalarParam, TensorParam, broadcast_shapes,
                 dsl_error, dtype_of, is_float, node_location, promote)

_state = threading.local()

f8e4, f16, bf16, f32, f64 = "f8e4", "f16", "bf16", "f32", "f64"
i8, u8, i16, i32, u32, i64 = "i8", "u8", "i16", "i32", "u32", "i64"


class constexpr:  # noqa: N801 - used as an annotation, like Triton's
    """Annotate a keyword argument as compile-time: each value gets its own specialization."""


# ---- the builder ---------------------------------------------------------------------------------
class Builder:
    def __init__(self, name: str):
        self.ir = KernelIR(name=name, params=[], body=Block())
        self.block = self.ir.body

    def emit(self, op, dtype, shape, srcs=(), arg=None) -> Node:
        for s in srcs:
            if isinstance(s, Node) and s.block is not None and not s.block.encloses(self.block):
                raise dsl_error(f"a value computed inside a loop is used outside it ({op}); "
                                "carry it in an accumulator (kd.zeros / kd.var) instead")
        n = Node(op, dtype, tuple(shape), tuple(srcs), arg, block=self.block, loc=node_location())
        self.block.nodes.append(n)
        return n


def builder() -> Builder:
    b = getattr(_state, "builder", None)
    if b is None:
        raise DSLError("kilnx.dsl functions can only be called while tracing a @kd.kernel or @kd.fusion")
    return b


class tracing:  # noqa: N801 - a context manager used as `with tracing(name) as b`
    def __init__(self, name):
        self.b = Builder(name)

    def __enter__(self) -> Builder:
        self.prev = getattr(_state, "builder", None)
        _state.builder = self.b
        return self.b

    def __exit__(self, *exc):
        _state.builder = self.prev


# ---- values --------------------------------------------------------------------------------------
def lift(x, like: "Value | None" = None) -> "Value":
    """A Python number becomes a constant; it takes the dtype of the value it meets (Triton's rule)."""
    if isinstance(x, Value):
        return x
    if isinstance(x, bool):
        return Value(builder().emit("const", "bool", (), arg=x))
    if isinstance(x, int):
        d = like.dtype if like is not None and not is_float(like.dtype) and like.dtype != "bool" else "i32"
        if like is not None and is_float(like.dtype):
            d = like.dtype
        if d == "i32" and not (-2**31 <= x < 2**31):
            d = "i64"
        return Value(builder().emit("const", d, (), arg=x))
    if isinstance(x, float):
        d = like.dtype if like is not None and is_float(like.dtype) else "f32"
        return Value(builder().emit("const", d, (), arg=x))
    raise dsl_error(f"cannot use {type(x).__name__} {x!r} in a kernel expression")


def _binary(op, a, b):
    if not isinstance(a, Value):
        a = lift(a, b)
    if not isinstance(b, Value):
        b = lift(b, a)
    shape = broadcast_shapes(a.shape, b.shape)
    d = opdefs.OPS[op].infer(a.dtype, b.dtype)
    if op in ("add", "sub", "mul", "floordiv", "mod", "maximum", "minimum") or op in ("and", "or", "xor"):
        common = promote(a.dtype, b.dtype)
        a, b = a.to(common), b.to(common)
    elif op in ("lt", "le", "gt", "ge", "eq", "ne"):
        common = promote(a.dtype, b.dtype)
        a, b = a.to(common), b.to(common)
    elif op == "truediv":
        a, b = a.to(d), b.to(d)
    return Value(builder().emit(op, d, shape, (a.node, b.node)))


def _unary(op, a):
    a = lift(a)
    d = opdefs.OPS[op].infer(a.dtype)
    if is_float(d):
        a = a.to(d)
    return Value(builder().emit(op, d, a.shape, (a.node,)))


class Value:
    __slots__ = ("node",)

    def __init__(self, node: Node):
        self.node = node

    dtype = property(lambda self: self.node.dtype)
    shape = property(lambda self: self.node.shape)
    ndim = property(lambda self: len(self.node.shape))

    def __bool__(self):
        raise dsl_error("Python `if`/`and`/`or`/`not` on a traced value; use kd.where(cond, a, b) "
                        "or branch on a kd.constexpr / tunable instead")

    def __index__(self):
        raise dsl_error("a traced value cannot be used as a Python int (range, indexing); "
                        "use kd.range for loops over runtime sizes")

    __int__ = __float__ = __index__

    def __iter__(self):
        raise dsl_error("cannot iterate over a traced value")

    def to(self, dtype) -> "Value":
        d = dtype_of(dtype)
        if d == self.dtype:
            return self
        return Value(builder().emit("cast", d, self.shape, (self.node,), arg=d))

    astype = to

    def bitcast(self, dtype) -> "Value":
        """The same bits read as another 32-bit type (i32/u32 <-> f32): no conversion instruction.
        Lets kernels build floats from integer codes with bit operations (the magic-number trick)."""
        d = dtype_of(dtype)
        if d == self.dtype:
            return self
        if {d, self.dtype} - {"i32", "u32", "f32"}:
            raise dsl_error(f"bitcast {self.dtype} -> {d}: only between 32-bit types (i32, u32, f32)")
        if not self.shape:
            raise dsl_error("bitcast needs a tile; scalars have no bitcast in every backend")
        return Value(builder().emit("bitcast", d, self.shape, (self.node,), arg=d))

    def f32(self):
        return self.to("f32")

    # arithmetic
    __add__ = lambda a, b: _binary("add", a, b)  # noqa: E731
    __radd__ = lambda a, b: _binary("add", b, a)  # noqa: E731
    __sub__ = lambda a, b: _binary("sub", a, b)  # noqa: E731
    __rsub__ = lambda a, b: _binary("sub", b, a)  # noqa: E731
    __mul__ = lambda a, b: _binary("mul", a, b)  # noqa: E731
    __rmul__ = lambda a, b: _binary("mul", b, a)  # noqa: E731
    __truediv__ = lambda a, b: _binary("truediv", a, b)  # noqa: E731
    __rtruediv__ = lambda a, b: _binary("truediv", b, a)  # noqa: E731
    __floordiv__ = lambda a, b: _binary("floordiv", a, b)  # noqa: E731
    __rfloordiv__ = lambda a, b: _binary("floordiv", b, a)  # noqa: E731
    __mod__ = lambda a, b: _binary("mod", a, b)  # noqa: E731
    __and__ = lambda a, b: _binary("and", a, b)  # noqa: E731
    __rand__ = lambda a, b: _binary("and", b, a)  # noqa: E731
    __or__ = lambda a, b: _binary("or", a, b)  # noqa: E731
    __ror__ = lambda a, b: _binary("or", b, a)  # noqa: E731
    __xor__ = lambda a, b: _binary("xor", a, b)  # noqa: E731
    __lshift__ = lambda a, b: _binary("shl", a, b)  # noqa: E731
    __rshift__ = lambda a, b: _binary("shr", a, b)  # noqa: E731
    __lt__ = lambda a, b: _binary("lt", a, b)  # noqa: E731
    __le__ = lambda a, b: _binary("le", a, b)  # noqa: E731
    __gt__ = lambda a, b: _binary("gt", a, b)  # noqa: E731
    __ge__ = lambda a, b: _binary("ge", a, b)  # noqa: E731
    __eq__ = lambda a, b: _binary("eq", a, b)  # noqa: E731
    __ne__ = lambda a, b: _binary("ne", a, b)  # noqa: E731
    __neg__ = lambda a: _unary("neg", a)  # noqa: E731
    __abs__ = lambda a: _unary("abs", a)  # noqa: E731
    __invert__ = lambda a: _unary("invert", a)  # noqa: E731
    __hash__ = object.__hash__

    def __matmul__(self, other):
        raise dsl_error("`@` is not defined on tiles; use kd.dot(a, b) (accumulates in fp32)")

    __rmatmul__ = __matmul__

    def __pow__(self, p):
        if isinstance(p, int) and 1 <= p <= 4:
            out = self
            for _ in builtins.range(p - 1):
                out = out * self
            return out
        return exp(log(self) * p)

    # in-place updates rebind accumulators (kd.zeros / kd.var); on plain values they make new ones
    def _inplace(self, op, other):
        new = _binary(op, self, other)
        if self.node.op == "var":
            assign(self, new)
            return self
        return new

    __iadd__ = lambda a, b: a._inplace("add", b)  # noqa: E731
    __isub__ = lambda a, b: a._inplace("sub", b)  # noqa: E731
    __imul__ = lambda a, b: a._inplace("mul", b)  # noqa: E731

    def __getitem__(self, idx):
        """Only `None` (new axis) and `:` are allowed: x[:, None], x[None, :]."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        shape, k = [], 0
        for i in idx:
            if i is None:
                shape.append(1)
            elif i == slice(None):
                if k >= len(self.shape):
                    raise dsl_error("too many indices")
                shape.append(self.shape[k])
                k += 1
            else:
                raise dsl_error("tile indexing takes only `:` and `None`; use kd.load for memory")
        shape += list(self.shape[k:])
        return Value(builder().emit("expand", self.dtype, tuple(shape), (self.node,), arg=tuple(
            i is None for i in idx)))

    def sum(self, axis=-1, keepdims=False):
        return reduce("sum", self, axis, keepdims)

    def max(self, axis=-1, keepdims=False):
        return reduce("max", self, axis, keepdims)

    def set(self, value) -> "Value":
        return assign(self, value)


class TensorArg:
    """A tensor parameter of a kernel (or an output it allocates): memory, reached by kd.load/store."""

    def __init__(self, param: TensorParam, dims: list[Node]):
        self.param, self.dims = param, dims

    @property
    def shape(self) -> tuple:
        return tuple(Value(d) for d in self.dims)

    @property
    def dtype(self) -> str:
        return self.param.dtype

    @property
    def ndim(self) -> int:
        return self.param.ndim

    def __bool__(self):
        return True


# ---- functions kernel authors call -----------------------------------------------------------------
def program_id(axis: int) -> Value:
    return Value(builder().emit("program_id", "i32", (), arg=axis))


def grid(*sizes) -> tuple[Value, ...] | Value:
    """Declare the launch grid (host-evaluated sizes); returns the program ids along each axis."""
    b = builder()
    if b.ir.grid:
        raise dsl_error("kd.grid is called once per kernel")
    if not 1 <= len(sizes) <= 3:
        raise dsl_error("a grid has 1 to 3 axes")
    b.ir.grid = tuple(lift(s).node for s in sizes)
    ids = tuple(program_id(i) for i in builtins.range(len(sizes)))
    return ids if len(ids) > 1 else ids[0]


def cdiv(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return (a + (b - 1)) // b


def arange(start: int, end: int) -> Value:
    if not (isinstance(start, int) and isinstance(end, int)) or end <= start:
        raise dsl_error("kd.arange needs compile-time ints start < end (use tunables or kd.constexpr)")
    if (end - start) & (end - start - 1):
        raise dsl_error(f"kd.arange({start}, {end}): the length must be a power of two")
    return Value(builder().emit("arange", "i32", (end - start,), arg=(start, end)))


def full(shape, value, dtype) -> Value:
    shape = tuple(shape)
    if not all(isinstance(s, int) for s in shape):
        raise dsl_error("tile shapes are compile-time ints")
    return Value(builder().emit("full", dtype_of(dtype), shape, arg=value))


def var(init) -> Value:
    """A mutable accumulator initialised to `init`; `+=`, `.set()` and kd.assign rebind it."""
    init = lift(init)
    return Value(builder().emit("var", init.dtype, init.shape, (init.node,)))


def zeros(shape, dtype="f32") -> Value:
    return var(full(shape, 0, dtype))


def assign(v: Value, value) -> Value:
    if not isinstance(v, Value) or v.node.op != "var":
        raise dsl_error("kd.assign/.set need an accumulator made by kd.zeros or kd.var")
    value = lift(value, v)
    if broadcast_shapes(v.shape, value.shape) != v.shape:
        raise dsl_error(f"cannot assign a {list(value.shape)} value to a {list(v.shape)} accumulator")
    value = value.to(v.dtype)
    if value.shape != v.shape:
        value = broadcast_to(value, v.shape)
    builder().emit("assign", v.dtype, v.shape, (v.node, value.node))
    return v


def range(start, stop=None, step=1, *, stages: int | None = None, flatten: bool = False):  # noqa: A001
    """A sequential loop over runtime bounds: `for k in kd.range(0, K, BLOCK_K):` (traced once).

    stages=S asks the backend to keep S iterations' loads in flight (Triton: the loop is software-
    pipelined through shared memory even when no dot consumes the loads, as a GEMV's are); stages=1
    turns pipelining off; None leaves it to the backend (Triton pipelines only loads feeding a dot).
    flatten=True lets the backend run this loop and the loops inside it as one (the same iterations in the
    same order; Triton then pipelines across the inner loop's ends)."""
    if stop is None:
        start, stop = 0, start
    if stages is not None and (not isinstance(stages, int) or stages < 1):
        raise dsl_error(f"kd.range stages must be a positive int, got {stages!r}")
    b = builder()
    start, stop, step = lift(start), lift(stop), lift(step)
    d = promote(promote(start.dtype, stop.dtype), step.dtype)
    body = Block(parent=b.block, stages=stages, flatten=bool(flatten))
    loop = b.emit("range", d, (), (start.node, stop.node, step.node), arg=body)
    loop.block = b.block
    b.block = body
    try:
        yield Value(loop)
    finally:
        b.block = body.parent


static_range = builtins.range
"""Unrolled at trace time: `for j in kd.static_range(8):` gives Python ints."""


def dot(a: Value, b: Value) -> Value:
    """(M, K) @ (K, N) -> (M, N) accumulated in fp32. Lowered to tensor cores when every dim >= 16,
    else to a broadcast multiply and a sum."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise dsl_error(f"kd.dot needs (M, K) @ (K, N), got {list(a.shape)} @ {list(b.shape)}")
    d = "f32" if is_float(a.dtype) else "i32"
    return Value(builder().emit("dot", d, (a.shape[0], b.shape[1]), (a.node, b.node)))


def where(cond, a, b) -> Value:
    cond = lift(cond)
    if not isinstance(a, Value) and not isinstance(b, Value):
        a = lift(a)
    a, b = (lift(a, b if isinstance(b, Value) else None), lift(b, a if isinstance(a, Value) else None))
    d = promote(a.dtype, b.dtype)
    a, b = a.to(d), b.to(d)
    shape = broadcast_shapes(cond.shape, a.shape, b.shape)
    return Value(builder().emit("where", d, shape, (cond.node, a.node, b.node)))


def reduce(kind: str, x: Value, axis: int = -1, keepdims: bool = False) -> Value:
    x = lift(getattr(x, "value", lambda: x)() if not isinstance(x, Value) else x)
    ctx = getattr(_state, "fusion", None)
    if ctx is not None and axis in (-1, x.ndim - 1) and x.ndim == 2:
        return ctx.reduce(kind, x, keepdims, mean=False)
    return raw_reduce(kind, x, axis, keepdims)


def raw_reduce(kind: str, x: Value, axis: int = -1, keepdims: bool = False) -> Value:
    x = lift(x)
    if x.ndim == 0:
        raise dsl_error(f"kd.{kind} of a scalar")
    ax = axis % x.ndim
    shape = tuple(s for i, s in enumerate(x.shape) if i != ax or keepdims)
    shape = tuple(1 if (i == ax and keepdims) else s for i, s in enumerate(x.shape)) if keepdims else shape
    return Value(builder().emit("reduce", opdefs.reduce_dtype(kind, x.dtype), shape, (x.node,),
                                arg=(kind, ax, keepdims)))


def reshape(x: Value, shape) -> Value:
    import math
    shape = tuple(shape)
    if math.prod(shape) != math.prod(x.shape):
        raise dsl_error(f"cannot reshape {list(x.shape)} to {list(shape)}")
    return Value(builder().emit("reshape", x.dtype, shape, (x.node,), arg=shape))


def broadcast_to(x: Value, shape) -> Value:
    x = lift(x)
    shape = tuple(shape)
    if broadcast_shapes(x.shape, shape) != shape:
        raise dsl_error(f"cannot broadcast {list(x.shape)} to {list(shape)}")
    if x.shape == shape:
        return x
    return Value(builder().emit("broadcast", x.dtype, shape, (x.node,), arg=shape))


def bitcast(x: Value, dtype) -> Value:
    return x.bitcast(dtype)


def join(a, b) -> Value:
    """(..., 2): a and b (same shape and dtype) side by side along a new last axis, a at 0. With a reshape
    it interleaves two tiles; the GPU keeps the new axis within each thread (tl.join), so building a
    tile from pieces computed in its own layout costs no data movement."""
    a, b = lift(a), lift(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise dsl_error(f"kd.join takes two tiles of one shape and dtype, got {a.dtype}{list(a.shape)} "
                        f"and {b.dtype}{list(b.shape)}")
    return Value(builder().emit("join", a.dtype, (*a.shape, 2), (a.node, b.node)))


def trans(x: Value) -> Value:
    if x.ndim != 2:
        raise dsl_error("kd.trans takes a 2-d tile")
    return Value(builder().emit("trans", x.dtype, x.shape[::-1], (x.node,)))


def permute(x: Value, dims) -> Value:
    """x's axes reordered: axis i of the result is axis dims[i] of x (np.transpose). With a reshape before
    and after it regroups a loaded tile, e.g. a 1-d load of bytes stored in the order the threads hold them
    into the logical tile (kernels/qmv_wg.py); on the GPU the layouts follow and no data moves."""
    x = lift(x)
    dims = tuple(int(d) for d in dims)
    if sorted(dims) != list(builtins.range(x.ndim)):
        raise dsl_error(f"kd.permute of a {x.ndim}-d tile takes a permutation of 0..{x.ndim - 1}, got {list(dims)}")
    return Value(builder().emit("permute", x.dtype, tuple(x.shape[d] for d in dims), (x.node,), arg=dims))


def scalar_param(name: str, value: Any) -> Value:
    d = "f32" if isinstance(value, float) else "i64" if isinstance(value, int) else None
    if d is None:
        raise DSLError(f"runtime argument {name}={value!r}: only float and int scalars; "
                       "annotate it kd.constexpr for other values")
    p = ScalarParam(name, d)
    b = builder()
    b.ir.params.append(p)
    return Value(b.emit("param", d, (), arg=name))


def tensor_param(name: str, dtype: str, ndim: int, output=False) -> TensorArg:
    p = TensorParam(name, dtype, ndim)
    b = builder()
    if not output:
        b.ir.params.append(p)
    dims = [b.emit("dim", "i32", (), arg=(name, i)) for i in builtins.range(ndim)]
    return TensorArg(p, dims)


# memory access, the half2 ops and the elementwise functions live beside this module; kernel authors see them all
# as kd.*
from .memory import (_mem_index, atomic_add, barrier, grid_dependency_sync, launch_dependents,  # noqa: E402,F401
                     load, load_tile, output, prefetch, store)
from .half2 import bf2_fma, bf2_half, byte_perm, h2_fma, h2_pack, h2_sum, nibbles  # noqa: E402,F401
from .elementwise import (abs, argmax, cos, erf, exp, gelu_tanh, log, max, maximum, mean,  # noqa: E402,F401,A004
                          min, minimum, rsqrt, sigmoid, silu, sin, softplus, sqrt, sum, tanh)
