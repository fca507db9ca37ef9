"""Bit-level float helpers shared by the quantization references.

numpy has no bfloat16 and no fp8, so the references hold every value as float32 and
*round* it to the narrower dtype where MLX would store or compute in that dtype.
Rounding a float32 result of one +, -, * or / to bf16/fp16 gives the same bits as
computing in that dtype directly (float32 has more than 2p+2 significand bits for
both), which is how MLX's CPU backend evaluates bf16/fp16 ops anyway.
"""

from __future__ import annotations

import numpy as np

# Dtype names understood by the references (the torch/MLX names).
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def check_float_dtype(dtype: str) -> str:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"unsupported float dtype {dtype!r}; use one of {FLOAT_DTYPES}")
    return dtype


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even); returns float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit makes truncation round half to even.
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = (bits + np.uint32(0x7FFF) + lsb) & np.uint32(0xFFFF0000)
    # NaN must stay NaN (the carry could turn a NaN payload into inf); keep a quiet NaN.
    nan = np.isnan(x)
    rounded = np.where(nan, (bits | np.uint32(0x00400000)) & np.uint32(0xFFFF0000), rounded)
    return rounded.astype(np.uint32).view(np.float32)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32 values to `dtype` ("float32", "float16", "bfloat16"); returns float32."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return round_to_bf16(x)
    raise ValueError(f"unsupported float dtype {dtype!r}; use one of {FLOAT_DTYPES}")


# e2m1 (fp4) code -> value, in MLX's code order: bit 3 is the sign.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    value = np.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    # e4m3fn has no inf; exponent 15 with mantissa 7 is NaN (MLX decodes it as NaN too).
    value = np.where((codes & 0x7F) == 0x7F, np.nan, value)
    return (sign * value).astype(np.float32)


E4M3_VALUES = _e4m3_table()


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """fp8 e4m3fn codes (uint8) -> float32 values."""
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> fp8 e4m3fn codes, rounding to nearest even and saturating at +-448.

    Saturation (not NaN) on overflow is what MLX's CPU `to_fp8` does; NaN inputs also
    saturate there, and we follow it.
    """
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    sign = ((bits >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint8)
    mag_bits = bits & np.uint32(0x7FFFFFFF)
    mag = mag_bits.view(np.float32)

    # Subnormal range (|x| < 2^-6): adding 2^(14-127+... ) i.e. float 2^14 aligns the
    # fp8 subnormal quantum 2^-9 with the float32 ulp, so the FPU does the RNE rounding.
    magic = np.float32(2.0**14)
    with np.errstate(over="ignore"):
        low = ((mag + magic).view(np.uint32) - magic.view(np.uint32)).astype(np.uint8)

    # Normal range: rebias the exponent (127 -> 7), round the 20 dropped mantissa bits
    # half to even, keep the top 8 bits.
    odd = (mag_bits >> np.uint32(20)) & np.uint32(1)
    rebias = np.uint32((127 - 7) << 23)
    with np.errstate(over="ignore"):
        high_bits = (mag_bits - rebias + np.uint32(0x7FFFF) + odd) >> np.uint32(20)
    high = (high_bits & np.uint32(0xFF)).astype(np.uint8)

    out = np.where(mag_bits < np.uint32(121 << 23), low, high)
    # 464 (= 543 << 21 as float bits) is the midpoint above 448: everything from there saturates.
    out = np.where(mag_bits >= np.uint32(543 << 21), np.uint8(0x7E), out)
    return (out | sign).astype(np.uint8)
