"""numpy references of MLX's quantized formats, bit-exact with `mx.quantize` / `mx.dequantize`.

Affine ("affine"): codes q in [0, 2**bits), w ~ scale * q + bias per group of
`group_size` consecutive elements of the last axis, codes packed LSB-first into uint32
(see bitpack.py). Scales and biases have the input's dtype.

Floating-point block formats (no bias, uint8 scale codes, codes packed 8 nibbles a word
for fp4 / 4 bytes a word for fp8, lowest element in the lowest bits):
  mxfp4: e2m1 values, e8m0 scale 2**(code-127), groups of 32
  nvfp4: e2m1 values, e4m3 scale, groups of 16, optional float32 global scale
  mxfp8: e4m3 values, e8m0 scale, groups of 32

How MLX computes (read from MLX 0.32 source, confirmed by the tests against mlx-cpu):
  * affine quantize runs a C++ loop entirely in float32 whatever the input dtype and
    casts the scale and bias to the input dtype only when storing them; the codes are
    computed with the unrounded float32 scale/bias.
  * the fp modes are evaluated as a graph of array ops *in the input dtype*: for bf16
    input every intermediate is rounded to bf16. We replay that graph op by op.
  * the e8m0 exponent is ceil(log2(amax / max_value)) in mlx 0.32.4 (measured; the
    0.32.2 source rounds log2 instead), and the e2m1 code is the first argmin of
    |x - lut|, so ties go to the smaller magnitude.
  * dequantize is `q * scale` then `+ bias` (two roundings, no FMA) in the scales dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .bitpack import pack_bits, unpack_bits
from .float_codecs import E2M1_VALUES, check_float_dtype, e4m3_decode, e4m3_encode, round_to

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class FpModeSpec:
    bits: int
    group_size: int
    max_value: float  # largest element magnitude: the scale maps the group amax onto it
    e4m3_scale: bool  # nvfp4: e4m3 scale codes; mx*: e8m0 exponent codes


FP_MODES = {
    "mxfp4": FpModeSpec(bits=4, group_size=32, max_value=6.0, e4m3_scale=False),
    "nvfp4": FpModeSpec(bits=4, group_size=16, max_value=6.0, e4m3_scale=True),
    "mxfp8": FpModeSpec(bits=8, group_size=32, max_value=448.0, e4m3_scale=False),
}

# 448 * 6: MLX's nvfp4 encodes scales relative to global_scale / (448 * 6).
_NVFP4_GLOBAL_RANGE = np.float32(448.0 * 6.0)


def dtype_name_of(array: np.ndarray) -> str:
    if array.dtype == np.float16:
        return "float16"
    if array.dtype == np.float32 or array.dtype == np.float64:
        return "float32"
    raise ValueError(f"expected a float32/float16 array (bf16 as float32 plus dtype='bfloat16'), got {array.dtype}")


def _grouped(w: np.ndarray, group_size: int, what: str) -> np.ndarray:
    if w.ndim < 1 or w.shape[-1] % group_size:
        raise ValueError(
            f"{what}: the last axis ({w.shape[-1] if w.ndim else 'scalar'}) must be a multiple of "
            f"group_size={group_size}; pad K or pick a group size that divides it"
        )
    return w.reshape(w.shape[:-1] + (w.shape[-1] // group_size, group_size))


def check_affine_params(bits: int, group_size: int) -> None:
    if bits not in AFFINE_BITS:
        raise ValueError(f"affine quantization supports bits in {AFFINE_BITS}, got bits={bits}")
    if group_size not in AFFINE_GROUP_SIZES:
        raise ValueError(
            f"affine quantization supports group_size in {AFFINE_GROUP_SIZES}, got group_size={group_size}"
        )


def affine_quantize(w: np.ndarray, group_size: int = 64, bits: int = 4, dtype: str | None = None):
    """Quantize (..., K) -> (packed uint32 (..., K*bits/32), scales, biases (..., K/group_size)).

    `dtype` is the dtype MLX would see ("float32", "float16", "bfloat16"; default: w's
    dtype). Inputs are first rounded to it, so float32 data with dtype="bfloat16" gives
    what `mx.quantize(w.astype(mx.bfloat16))` gives. Scales and biases are returned as
    float32 arrays holding values exactly representable in `dtype`.
    """
    check_affine_params(bits, group_size)
    w = np.asarray(w)
    dtype = check_float_dtype(dtype or dtype_name_of(w))
    groups = _grouped(round_to(w.astype(np.float32), dtype), group_size, "affine_quantize")

    n_bins = np.float32((1 << bits) - 1)
    w_max = groups.max(axis=-1)
    w_min = groups.min(axis=-1)
    # The edge with the larger magnitude is represented exactly (q = 0 or q = n_bins):
    # a negative scale when that edge is the maximum.
    min_is_edge = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(min_is_edge, scale, -scale)
    edge = np.where(min_is_edge, w_min, w_max)
    q0 = np.rint(edge / scale)
    nonzero = q0 != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(nonzero, edge / q0, scale).astype(np.float32)
    bias = np.where(nonzero, edge, np.float32(0)).astype(np.float32)

    q = np.rint((groups - bias[..., None]) / scale[..., None])
    q = np.clip(q, 0, n_bins).astype(np.uint8).reshape(w.shape)
    return pack_bits(q, bits), round_to(scale, dtype), round_to(bias, dtype)


def affine_dequantize(packed, scales, biases, group_size: int = 64, bits: int = 4, dtype: str = "float32"):
    """Dequantize as MLX does in `dtype` (the scales dtype): round(round(q*scale) + bias).

    Returns float32 values exactly representable in `dtype`.
    """
    check_affine_params(bits, group_size)
    check_float_dtype(dtype)
    q = unpack_bits(packed, bits).astype(np.float32)
    groups = _grouped(q, group_size, "affine_dequantize")
    scales = np.asarray(scales, dtype=np.float32)[..., None]
    biases = np.asarray(biases, dtype=np.float32)[..., None]
    if groups.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"scales shape {scales.shape[:-1]} does not match packed groups {groups.shape[:-1]}")
    out = round_to(round_to(groups * scales, dtype) + biases, dtype)
    return out.reshape(q.shape)


# ----------------------------------------------------------------------------- fp modes


def fp_mode_spec(mode: str) -> FpModeSpec:
    if mode not in FP_MODES:
        raise ValueError(f"unknown floating-point quantization mode {mode!r}; use one of {tuple(FP_MODES)}")
    return FP_MODES[mode]


def _nearest_e2m1_codes(x: np.ndarray, dtype: str) -> np.ndarray:
    """Index of the nearest LUT entry, first one on ties (MLX takes an argmin over the LUT
    of |x - lut| computed in `dtype`). We replay the rounding of the distances for
    faithfulness; near a decision midpoint the distances are small multiples of the LUT
    spacing and exact, so it has not been seen to change a code (no test can tell).

    Ties therefore go to the smaller magnitude (0.75 -> 0.5), not to the even mantissa.
    """
    diff = np.abs(round_to(x[..., None] - E2M1_VALUES, dtype))
    return np.argmin(diff, axis=-1).astype(np.uint8)


def fp_quantize(w: np.ndarray, mode: str, dtype: str | None = None, global_scale: float | None = None):
    """Quantize (..., K) to an fp mode -> (packed uint32 (..., K*bits/32), scale codes uint8 (..., K/gs))."""
    spec = fp_mode_spec(mode)
    w = np.asarray(w)
    dtype = check_float_dtype(dtype or dtype_name_of(w))
    if global_scale is not None and mode != "nvfp4":
        raise ValueError(f"global_scale is only used by nvfp4, not {mode}")
    g = _grouped(round_to(w.astype(np.float32), dtype), spec.group_size, f"{mode} quantize")

    rd = lambda x: round_to(x, dtype)  # noqa: E731  (one MLX op in `dtype`)
    scale = rd(np.abs(g).max(axis=-1, keepdims=True) / np.float32(spec.max_value))
    if spec.e4m3_scale:
        # MLX multiplies by a float32 array here, so everything after this is float32.
        encode = np.float32(1.0) if global_scale is None else np.float32(_NVFP4_GLOBAL_RANGE / np.float32(global_scale))
        scale_codes = e4m3_encode(np.float32(scale * encode))
        with np.errstate(divide="ignore", invalid="ignore"):
            values = rd(g / rd(e4m3_decode(scale_codes)))
        values = (values * encode).astype(np.float32)
    else:
        # e8m0 exponent = ceil(log2(scale)), so amax / 2**e <= max_value (no clipping of the
        # largest element). Measured on mlx 0.32.4; the 0.32.2 source rounded log2 instead.
        # frexp gives the exact ceil: scale = m * 2**e with m in [0.5, 1).
        mantissa, exponent = np.frexp(scale)
        exponent = np.where(mantissa == 0.5, exponent - 1, exponent)
        exponent = np.where(scale == 0, 0, exponent).astype(np.float32)
        values = rd(g / rd(np.exp2(exponent)))
        # Exponents outside [-127, 127] (subnormal or huge groups) wrap modulo 256, as MLX's
        # float -> uint8 cast does on this platform (checked in the tests).
        scale_codes = (exponent + 127).astype(np.int32).astype(np.uint8)
    values = values.reshape(w.shape)
    if spec.bits == 4:
        # nvfp4 values were promoted to float32 by the scale encode factor; mx* stay in dtype.
        codes = _nearest_e2m1_codes(values, "float32" if spec.e4m3_scale else dtype)
        packed = pack_bits(codes, 4)
    else:
        packed = pack_bits(e4m3_encode(values), 8)
    return packed, scale_codes[..., 0]


def fp_dequantize(packed, scale_codes, mode: str, dtype: str = "float32", global_scale: float | None = None):
    """Dequantize an fp mode as MLX does in `dtype`; returns float32 values.

    With an nvfp4 global scale MLX's result is float32 whatever `dtype` is (the global
    scale is a float32 array and promotes); we return exactly those values.
    """
    spec = fp_mode_spec(mode)
    check_float_dtype(dtype)
    rd = lambda x: round_to(x, dtype)  # noqa: E731
    codes = unpack_bits(packed, spec.bits)
    if spec.bits == 4:
        values = rd(E2M1_VALUES[codes])
    else:
        values = rd(e4m3_decode(codes))
    groups = _grouped(values, spec.group_size, f"{mode} dequantize")
    scale_codes = np.asarray(scale_codes, dtype=np.uint8)[..., None]
    if groups.shape[:-1] != scale_codes.shape[:-1]:
        raise ValueError(f"scales shape {scale_codes.shape[:-1]} does not match packed groups {groups.shape[:-1]}")
    if spec.e4m3_scale:
        scale = rd(e4m3_decode(scale_codes))
        if global_scale is None:
            out = rd(groups * scale)
        else:
            inv_encode = np.float32(np.float32(global_scale) / rd(_NVFP4_GLOBAL_RANGE))
            out = (groups * np.float32(scale * inv_encode)).astype(np.float32)
    else:
        exponent = rd(scale_codes.astype(np.float32) - np.float32(127))
        out = rd(groups * rd(np.exp2(exponent)))
    return out.reshape(values.shape)
