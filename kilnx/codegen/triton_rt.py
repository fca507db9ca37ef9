"""Triton helpers that generated kernels call as `_rt.<name>` for ops with no `tl.*` spelling.

The packed-half2 ops (kilnx/dsl/opdefs.py) are one PTX instruction each on the GPU. Triton's
interpreter cannot run inline PTX, so under TRITON_INTERPRET=1 each helper computes the same bits
with Triton ops instead (fp16 halves widened to fp64, where fp16 products and sums are exact, then
rounded once). The choice is a constexpr: the compiled GPU kernel contains only the PTX.
"""

import os

import triton
import triton.language as tl

INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _half(a, shift: tl.constexpr):
    return ((a >> shift) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float64)


@triton.jit
def _bits(v):
    return v.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def h2_pack(lo, hi):
    """Two floats rounded to fp16 (nearest even) in one u32, `lo` in the low half."""
    return _bits(lo.to(tl.float32)) | (_bits(hi.to(tl.float32)) << 16)


@triton.jit
def h2_fma(a, b, c):
    """a * b + c on both fp16 halves, rounded once (fma.rn.f16x2)."""
    if INTERPRET:
        lo = _half(a, 0) * _half(b, 0) + _half(c, 0)
        hi = _half(a, 16) * _half(b, 16) + _half(c, 16)
        return _bits(lo) | (_bits(hi) << 16)
    else:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def h2_sum(a):
    """The two fp16 halves widened to fp32 and added."""
    if INTERPRET:
        return _half(a, 0).to(tl.float32) + _half(a, 16).to(tl.float32)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .f16 l, h; .reg .f32 x, y; mov.b32 {l, h}, $1; cvt.f32.f16 x, l; cvt.f32.f16 y, h; "
            "add.rn.f32 $0, x, y; }", "=f,r", [a], dtype=tl.float32, is_pure=True, pack=1)
