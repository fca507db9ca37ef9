"""Scalar helpers the generated numba code calls, one element at a time: raw pointers from addresses,
16-bit float conversions, bit reinterpretation, erf.

The lowering (numba_gen) emits explicit loops over tile elements, so every helper here takes and
returns scalars; LLVM inlines them into those loops. Intrinsics are single LLVM instructions (a
pointer cast, a bitcast, an fpext/fptrunc through `half`), which numba's Python-level API cannot say.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir as llvm_ir
from numba import njit, types
from numba.extending import intrinsic

_NJ = dict(cache=True, nogil=True, inline="always")

def _pointer_from_address(elem):
    @intrinsic
    def pointer(typingctx, address):
        sig = types.CPointer(elem)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(elem)))
        return sig, codegen
    return pointer


# ptr_<dtype>(tensor.data_ptr()) -> a typed pointer indexed like a flat array (no bounds, no refcount)
ptr_f16 = ptr_bf16 = ptr_u16 = _pointer_from_address(types.uint16)
ptr_f32 = _pointer_from_address(types.float32)
ptr_f64 = _pointer_from_address(types.float64)
ptr_i8 = _pointer_from_address(types.int8)
ptr_u8 = ptr_bool = ptr_f8e4 = _pointer_from_address(types.uint8)
ptr_i16 = _pointer_from_address(types.int16)
ptr_i32 = _pointer_from_address(types.int32)
ptr_u32 = _pointer_from_address(types.uint32)
ptr_i64 = _pointer_from_address(types.int64)


def _stack_array(elem):
    @intrinsic(prefer_literal=True)
    def stack(typingctx, count):
        if not isinstance(count, types.IntegerLiteral):
            return None
        n = count.literal_value
        sig = types.CPointer(elem)(count)

        def codegen(context, builder, signature, args):
            with builder.goto_entry_block():
                ptr = builder.alloca(context.get_data_type(elem), size=llvm_ir.Constant(llvm_ir.IntType(64), n))
                ptr.align = 32
            return ptr
        return sig, codegen
    return stack


# stack_<dtype>(N): a tile buffer of N elements on the stack, as a pointer. LLVM knows a stack slot
# whose address never escapes aliases no tensor, so loops that read tensors and write tiles vectorize
# without runtime overlap checks (which it refuses for the short loops tiles make).
stack_f32 = _stack_array(types.float32)
stack_f64 = _stack_array(types.float64)
stack_i8 = _stack_array(types.int8)
stack_u8 = stack_bool = _stack_array(types.uint8)
stack_i16 = _stack_array(types.int16)
stack_i32 = _stack_array(types.int32)
stack_u32 = _stack_array(types.uint32)
stack_i64 = _stack_array(types.int64)


def _bitcast_to(dst, llvm_dst):
    @intrinsic
    def bitcast(typingctx, x):
        if not isinstance(x, (types.Integer, types.Float)) or x.bitwidth != 32:
            return None
        sig = dst(x)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], llvm_dst)
        return sig, codegen
    return bitcast


# the same 32 bits read as another type (kd.bitcast)
as_f32 = _bitcast_to(types.float32, llvm_ir.FloatType())
as_i32 = _bitcast_to(types.int32, llvm_ir.IntType(32))
as_u32 = _bitcast_to(types.uint32, llvm_ir.IntType(32))


@intrinsic
def _f16_bits_to_f32(typingctx, u):
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], llvm_ir.HalfType()), llvm_ir.FloatType())
    return sig, codegen


@intrinsic
def _f32_to_f16_bits(typingctx, x):
    """IEEE fptrunc: round to nearest even, overflow to inf, NaN stays NaN (numpy's astype(float16))."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], llvm_ir.HalfType()), llvm_ir.IntType(16))
    return sig, codegen


@njit(**_NJ)
def f16_bits_to_f32(u):
    return _f16_bits_to_f32(np.uint16(u))


@njit(**_NJ)
def f32_to_f16_bits(x):
    return _f32_to_f16_bits(np.float32(x))


@njit(**_NJ)
def round_f16(x):
    return _f16_bits_to_f32(_f32_to_f16_bits(np.float32(x)))


@njit(**_NJ)
def bf16_bits_to_f32(u):
    return as_f32(np.uint32(np.uint32(u) << np.uint32(16)))   # numba widens uint32 shifts to 64 bits


@njit(**_NJ)
def f32_to_bf16_bits(x):
    """Round to nearest even on the upper 16 bits; NaN stays a (quiet) NaN."""
    f = np.float32(x)
    b = as_u32(f)
    if f != f:
        return np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(**_NJ)
def round_bf16(x):
    f = np.float32(x)
    if f != f:
        return f
    return bf16_bits_to_f32(f32_to_bf16_bits(f))


from kilnx.quant.float_codecs import E4M3_VALUES as _E4M3_VALUES   # noqa: E402  (code -> value, NaN at 0x7F)


@njit(**_NJ)
def f8e4_bits_to_f32(u):
    return _E4M3_VALUES[np.uint8(u)]


@njit(**_NJ)
def f32_to_f8e4_bits(x):
    """fp32 -> e4m3fn bits: round to nearest even, saturating at +-448, NaN kept (reference.round_to's rule)."""
    b = as_u32(np.float32(x))
    sign = np.uint32((b >> np.uint32(24)) & np.uint32(0x80))
    mag = np.uint32(b & np.uint32(0x7FFFFFFF))
    if mag > np.uint32(0x7F800000):
        return np.uint8(sign | np.uint32(0x7F))
    if mag >= np.uint32(543 << 21):                  # 464 (halfway past 448) and beyond, infinity included
        return np.uint8(sign | np.uint32(0x7E))
    if mag < np.uint32(121 << 23):                   # below 2^-6: subnormal codes, the fp32 add rounds to 2^-9
        magic = np.float32(16384.0)
        low = np.uint32(as_u32(np.float32(as_f32(mag) + magic)) - as_u32(magic))
        return np.uint8(sign | low)
    odd = np.uint32((mag >> np.uint32(20)) & np.uint32(1))
    high = np.uint32((mag - np.uint32(120 << 23) + np.uint32(0x7FFFF) + odd) >> np.uint32(20))
    return np.uint8(sign | (high & np.uint32(0xFF)))


@njit(**_NJ)
def round_f8e4(x):
    f = np.float32(x)
    if f != f:
        return f
    return f8e4_bits_to_f32(f32_to_f8e4_bits(f))


@njit(**_NJ)
def _f64_to_f32_odd(x):
    """float64 -> fp32 rounded to odd (truncate, then set the last bit if anything was dropped): a later
    rounding to a format with at least 2 fewer bits (fp16: 13, bf16: 16) is then the one rounding of x."""
    r = np.float32(x)
    if np.float64(r) != x:
        bits = as_u32(r)
        if abs(np.float64(r)) > abs(x):
            bits = np.uint32(bits - np.uint32(1))      # toward zero: same sign, smaller magnitude
        r = as_f32(np.uint32(bits | np.uint32(1)))
    return r


@njit(**_NJ)
def _f64_to_f16_bits(x):
    """float64 -> fp16 bits with one rounding. LLVM lowers a direct double->half truncation to a
    library call that numba's JIT does not link, so go through fp32 rounded to odd."""
    return _f32_to_f16_bits(_f64_to_f32_odd(x))


@njit(**_NJ)
def _h2_half(a, shift):
    return np.float64(_f16_bits_to_f32(np.uint16((np.uint32(a) >> np.uint32(shift)) & np.uint32(0xFFFF))))


@njit(**_NJ)
def h2_pack(lo, hi):
    """Packed half2 (kilnx/dsl/opdefs.py): two floats rounded to fp16, `lo` in the low half."""
    return np.uint32(_f32_to_f16_bits(np.float32(lo))) | (np.uint32(_f32_to_f16_bits(np.float32(hi))) << np.uint32(16))


@njit(**_NJ)
def h2_fma(a, b, c):
    # fp16 products and their sums with an fp16 value are exact in float64: one rounding, as on the GPU
    lo = _h2_half(a, 0) * _h2_half(b, 0) + _h2_half(c, 0)
    hi = _h2_half(a, 16) * _h2_half(b, 16) + _h2_half(c, 16)
    return np.uint32(_f64_to_f16_bits(lo)) | (np.uint32(_f64_to_f16_bits(hi)) << np.uint32(16))


@njit(**_NJ)
def h2_sum(a):
    return np.float32(_h2_half(a, 0)) + np.float32(_h2_half(a, 16))


@njit(**_NJ)
def erf(x):
    return math.erf(np.float64(x))   # in float64, as the reference; the caller rounds to its dtype


@njit(**_NJ)
def _bf2_part(a, shift):
    return np.float64(bf16_bits_to_f32(np.uint16((np.uint32(a) >> np.uint32(shift)) & np.uint32(0xFFFF))))


@njit(**_NJ)
def _f64_to_bf16_bits(x):
    """float64 -> bf16 bits with one rounding, through fp32 rounded to odd."""
    return np.uint32(f32_to_bf16_bits(_f64_to_f32_odd(x)))


@njit(**_NJ)
def bf2_fma(a, b, c):
    lo = _bf2_part(a, 0) * _bf2_part(b, 0) + _bf2_part(c, 0)
    hi = _bf2_part(a, 16) * _bf2_part(b, 16) + _bf2_part(c, 16)
    return _f64_to_bf16_bits(lo) | (_f64_to_bf16_bits(hi) << np.uint32(16))


@njit(**_NJ)
def bf2_half(x, h):
    return bf16_bits_to_f32(np.uint16((np.uint32(x) >> np.uint32(16 * h)) & np.uint32(0xFFFF)))


@njit(**_NJ)
def byte_perm(a, b, sel):
    both = np.uint64(a) | (np.uint64(b) << np.uint64(32))
    out = np.uint64(0)
    for i in range(4):
        nib = (np.uint64(sel) >> np.uint64(4 * i)) & np.uint64(15)
        byte = (both >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        if nib & np.uint64(8):
            byte = np.uint64(0xFF) if byte & np.uint64(0x80) else np.uint64(0)
        out |= byte << np.uint64(8 * i)
    return np.uint32(out)


@njit(**_NJ)
def nibble(byte, h):
    """kd.nibbles without a scale: 128 + code h (0: bits 0-3, 1: bits 4-7) of a byte."""
    return np.float32(128 + ((np.uint32(byte) >> np.uint32(4 * h)) & np.uint32(15)))


@njit(**_NJ)
def nibble_dequant(byte, h, s, b):
    """kd.nibbles with a scale: code * s + b rounded to bf16 once (exact in float64, rounded to odd into fp32
    so that the bf16 rounding after it is the only one)."""
    q = np.float64((np.uint32(byte) >> np.uint32(4 * h)) & np.uint32(15))
    return round_bf16(_f64_to_f32_odd(q * np.float64(s) + np.float64(b)))
