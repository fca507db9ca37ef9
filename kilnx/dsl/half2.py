"""Packed half2 values in the tile language: two fp16 values in one u32, low half first (the ops' meanings
and lowerings are in kilnx/dsl/opdefs.py)."""

from __future__ import annotations

from .ir import broadcast_shapes, dsl_error
from .lang import Value, builder, full, lift


def _h2(x, like: Value | None, what: str) -> Value:
    if isinstance(x, int):   # a constant pair, written as its 32 bits (0x3C003C00 is (1.0, 1.0))
        if not 0 <= x < 2**32:
            raise dsl_error(f"{what}: a half2 constant is the u32 of its bits, got {x}")
        return full(like.shape if like is not None else (), x, "u32")
    if not isinstance(x, Value) or x.dtype != "u32":
        raise dsl_error(f"{what} takes packed half2 values (u32 tiles from kd.h2_pack or bit operations), "
                        f"got {getattr(x, 'dtype', type(x).__name__)}")
    return x


def h2_pack(lo, hi) -> Value:
    """Two float tiles rounded to fp16 and packed into one u32 tile (lo in the low 16 bits)."""
    lo, hi = lift(lo).to("f32"), lift(hi).to("f32")
    shape = broadcast_shapes(lo.shape, hi.shape)
    return Value(builder().emit("h2_pack", "u32", shape, (lo.node, hi.node)))


def h2_fma(a, b, c) -> Value:
    """a * b + c on both fp16 halves, one rounding each (one HFMA2 instruction on the GPU)."""
    like = next((v for v in (a, b, c) if isinstance(v, Value)), None)
    a, b, c = (_h2(v, like, "kd.h2_fma") for v in (a, b, c))
    shape = broadcast_shapes(a.shape, b.shape, c.shape)
    return Value(builder().emit("h2_fma", "u32", shape, (a.node, b.node, c.node)))


def h2_sum(a) -> Value:
    """The two fp16 halves of each element, widened to fp32 and added."""
    a = _h2(a, None, "kd.h2_sum")
    return Value(builder().emit("h2_sum", "f32", a.shape, (a.node,)))
