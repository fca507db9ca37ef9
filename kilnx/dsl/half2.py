"""Packed half2 values in the tile language: two fp16 values in one u32, low half first (the ops' meanings
and lowerings are in kilnx/dsl/opdefs.py)."""

from __future__ import annotations

from .ir import broadcast_shapes, dsl_error
from .lang import Value, broadcast_to, builder, full, lift


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


# ---- bf16 pairs: the same packing with bf16 halves, for operands of bf16 tensor-core products ----------
def bf2_fma(a, b, c) -> Value:
    """a * b + c on both bf16 halves, one rounding each (fma.rn.bf16x2 on the GPU)."""
    like = next((v for v in (a, b, c) if isinstance(v, Value)), None)
    a, b, c = (_h2(v, like, "kd.bf2_fma") for v in (a, b, c))
    shape = broadcast_shapes(a.shape, b.shape, c.shape)
    return Value(builder().emit("bf2_fma", "u32", shape, (a.node, b.node, c.node)))


def bf2_half(x, h) -> Value:
    """The bf16 value in half h (0: low 16 bits, 1: high) of each packed pair x; h broadcasts with x, so
    `kd.bf2_half(x[..., None], kd.arange(0, 2))` spreads pairs into their elements along a new last axis."""
    x = _h2(x, None, "kd.bf2_half")
    h = lift(h)
    if h.dtype not in ("i32", "u32"):
        raise dsl_error(f"kd.bf2_half takes an integer half index (0 or 1), got {h.dtype}")
    return Value(builder().emit("bf2_half", "bf16", broadcast_shapes(x.shape, h.shape), (x.node, h.node)))


def byte_perm(a, b, selector) -> Value:
    """PTX prmt: byte i of the result is byte (selector >> 4i) & 7 of the eight bytes of b:a (a's bytes
    0-3, b's 4-7), its sign replicated when bit 3 of that nibble is set. One instruction on the GPU; e.g.
    selector 0x4141 puts a's byte 1 in bytes 0 and 2 and zeros (b = 0) in bytes 1 and 3."""
    like = next((v for v in (a, b, selector) if isinstance(v, Value)), None)
    # any integer tile: its 32 bits (a selector is often arithmetic on kd.arange, an i32)
    a, b, selector = (v.to("u32") if isinstance(v, Value) and v.dtype == "i32" else v for v in (a, b, selector))
    a, b, selector = (_h2(v, like, "kd.byte_perm") for v in (a, b, selector))
    shape = broadcast_shapes(a.shape, b.shape, selector.shape)
    return Value(builder().emit("byte_perm", "u32", shape, (a.node, b.node, selector.node)))


def nibbles(byt, scale=None, bias=None) -> Value:
    """The two 4-bit codes of each byte as bf16, on a new last axis of 2 (0: bits 0-3, 1: bits 4-7).
    Without scale and bias: 128 + q, exact (bf16's "magic" form: a product with it minus 128 times the
    other operand's sum is the product with q). With both (broadcast over the bytes): q * scale + bias,
    rounded to bf16 once, as a 4-bit affine weight dequantized to bf16.

    On the GPU four bytes (one register) decode at a time in one asm (two byte permutes, four LOP3, and two
    bf16x2 FMAs per output register when dequantizing), and the new axis stays in each thread, so the result
    can feed kd.dot as the tensor cores' register operand with no data movement (kernels/qmv_wg.py)."""
    byt = lift(byt)
    if byt.dtype != "u8":
        raise dsl_error(f"kd.nibbles decodes u8 tiles (two 4-bit codes a byte), got {byt.dtype}")
    if (scale is None) != (bias is None):
        raise dsl_error("kd.nibbles takes both scale and bias (q * scale + bias) or neither (128 + q)")
    srcs = (byt.node,)
    if scale is not None:
        s, b = (broadcast_to(lift(v).to("bf16"), byt.shape) for v in (scale, bias))
        srcs += (s.node, b.node)
    return Value(builder().emit("nibbles", "bf16", (*byt.shape, 2), srcs))
