"""GGUF (ggml) tensors -> kilnx weights.

Every kilnx result uses float32 scales and biases: a GGUF block scale is an fp16 `d`
times a small integer sub-scale, which float32 holds exactly and fp16/bf16 do not.

Lossless repacks (dequantize() equals `gguf.quants.dequantize` bit for bit, because both
evaluate the same float32 expression: q*d is exact and the one rounding is the add):
  Q4_0 -> affine 4-bit, group 32: scale d,        bias -8d
  Q4_1 -> affine 4-bit, group 32: scale d,        bias m
  Q5_0 -> affine 5-bit, group 32: scale d,        bias -16d
  Q5_1 -> affine 5-bit, group 32: scale d,        bias m
  Q8_0 -> affine 8-bit, group 32: q+128, scale d, bias -128d
  Q4_K -> affine 4-bit, group 32: scale d*sc_j,   bias -(dmin*m_j)   (8 sub-blocks of 32)
  Q5_K -> affine 5-bit, group 32: same as Q4_K with a fifth bit
  MXFP4 -> mxfp4 (same e8m0 scale byte; nibbles reordered)
  NVFP4 -> nvfp4 without global scale (same e4m3 scale byte; nibbles reordered)
Requantized (sub-blocks of 16 with their own scales do not fit MLX's group sizes):
  Q6_K, Q3_K, Q2_K -> gguf dequantize, then affine 8-bit group 32 with bias = group min,
  scale = group range / 255 (minmax_affine_quantize).
  Error bound per element: |err| <= (max - min of its 32-group) / 510 + 2 ulp(max|w|),
  half a quantization step. Measured on random blocks (tests): max |err| / group range
  = 1/510 to within float rounding, and max |err| / max|w| of the tensor < 0.4%.
Dense F32, F16, BF16 pass through as torch tensors of that dtype.

GGUF layouts differ from MLX's: Q4/Q5 blocks keep element j in the low nibble of byte j
and element j+16 in the high nibble (MLX: element 2j low, 2j+1 high).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from .bitpack import pack_bits
from .qweight import QuantFormat, QWeight

REQUANT_BITS = 8  # for the 16-element-sub-block K-quants; 8 bits keeps error at half a 1/255 step
LOSSLESS_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "MXFP4", "NVFP4")
REQUANTIZED_TYPES = ("Q6_K", "Q3_K", "Q2_K")
DENSE_TYPES = ("F32", "F16", "BF16")


def _f16(b: np.ndarray) -> np.ndarray:
    """Two little-endian bytes per row -> float32 value (exact)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _split_nibbles_half(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes in GGUF's order: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b):
    d = _f16(b[:, 0:2])
    return _split_nibbles_half(b[:, 2:18]), 4, d, -8 * d


def _q4_1(b):
    return _split_nibbles_half(b[:, 4:20]), 4, _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes (a little-endian uint32) -> 32 high bits, bit j for element j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q5_0(b):
    d = _f16(b[:, 0:2])
    codes = _split_nibbles_half(b[:, 6:22]) | (_fifth_bits(b[:, 2:6]) << 4)
    return codes, 5, d, -16 * d


def _q5_1(b):
    codes = _split_nibbles_half(b[:, 8:24]) | (_fifth_bits(b[:, 4:8]) << 4)
    return codes, 5, _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q8_0(b):
    d = _f16(b[:, 0:2])
    codes = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, 8, d, -128 * d


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins.

    Sub-blocks 0-3 use the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks
    4-7 take their low 4 bits from bytes 8-11 and their top 2 bits from the top bits of
    bytes 0-3 / 4-7.
    """
    lo_sc, lo_mn, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = np.concatenate([lo_sc & 0x3F, (mixed & 0x0F) | ((lo_sc >> 6) << 4)], axis=-1)
    mins = np.concatenate([lo_mn & 0x3F, (mixed >> 4) | ((lo_mn >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_quant_groups(b: np.ndarray, qs: np.ndarray, high: np.ndarray | None):
    """Shared Q4_K/Q5_K decoding to (codes (n, 256), scale (n, 8), bias (n, 8))."""
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales_mins(b[:, 4:16])
    # 4 chunks of 32 bytes; chunk c holds sub-block 2c in low nibbles, 2c+1 in high ones.
    chunks = qs.reshape(n, 4, 32)
    codes = np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(n, 8, 32)
    if high is not None:  # Q5_K: bit i of byte j is the fifth bit of element j of sub-block i
        bits = (high[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
        codes = codes | (bits << 4)
    return codes.reshape(n, 256), d[:, None] * sc, -(dmin[:, None] * mn)


def _q4_k(b):
    codes, scale, bias = _k_quant_groups(b, b[:, 16:144], None)
    return codes, 4, scale, bias


def _q5_k(b):
    codes, scale, bias = _k_quant_groups(b, b[:, 48:176], b[:, 16:48])
    return codes, 5, scale, bias


_AFFINE_REPACKS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
                   "Q4_K": _q4_k, "Q5_K": _q5_k}


def _mxfp4(b):
    # GGUF's doubled-value table uses the same code order as MLX's e2m1 LUT, and its
    # "half" e8m0 decode times doubled values equals 2**(e-127) * value: same scale byte.
    return _split_nibbles_half(b[:, 1:17]), b[:, 0]


def _nvfp4(b):
    # 64 elements = 4 sub-blocks of 16: 4 scale bytes, then 8 bytes per sub-block with
    # element i in the low nibble of byte i and element i+8 in the high nibble.
    n = b.shape[0]
    scales = b[:, 0:4]
    if np.any(scales >= 0x80):
        raise ValueError("NVFP4 block has a scale byte >= 0x80 (sign bit set), which GGUF's unsigned e4m3 "
                         "decoder treats differently from e4m3fn; cannot repack losslessly")
    # GGUF decodes 0x7F (e4m3fn NaN) as 0; so does code 0x00.
    scales = np.where(scales == 0x7F, np.uint8(0), scales)
    qs = b[:, 4:36].reshape(n, 4, 8)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, 64)
    return codes, scales


# ----------------------------------------------------------------------------- entry point


def _ggml_type(ggml_type) -> GGMLQuantizationType:
    try:
        if isinstance(ggml_type, str):
            return GGMLQuantizationType[ggml_type.upper()]
        return GGMLQuantizationType(ggml_type)
    except (KeyError, ValueError):
        raise ValueError(f"unknown ggml type {ggml_type!r}") from None


def _blocks(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if len(shape) < 2:
        raise ValueError(f"{qtype.name} tensors must be at least 2-D (rows, cols), got shape {shape}")
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if cols % block_size:
        raise ValueError(f"cols={cols} is not a multiple of the {qtype.name} block size {block_size}")
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    expected = rows * cols // block_size * type_size
    if raw.size != expected:
        raise ValueError(f"{qtype.name} tensor of shape {shape} needs {expected} bytes, got {raw.size}; "
                         "pass shape in torch order (reversed GGUF dims)")
    return raw.reshape(-1, type_size)


def _dense(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple) -> torch.Tensor:
    raw = np.ascontiguousarray(raw)
    if qtype == GGMLQuantizationType.F32:
        t = torch.from_numpy(raw.view(np.float32).copy())
    elif qtype == GGMLQuantizationType.F16:
        t = torch.from_numpy(raw.view(np.float16).copy())
    else:  # BF16: the top half of a float32
        bits = raw.view(np.uint16).astype(np.uint32) << 16
        t = torch.from_numpy(bits.view(np.float32)).to(torch.bfloat16)
    if t.numel() != int(np.prod(shape)):
        raise ValueError(f"{qtype.name} tensor has {t.numel()} values, shape {shape} needs {int(np.prod(shape))}")
    return t.reshape(shape)


def from_gguf(raw: np.ndarray, ggml_type, shape) -> QWeight | torch.Tensor:
    """Convert one GGUF tensor: `raw` as `GGUFReader` gives `tensor.data`, `shape` in torch
    order (rows, cols) = reversed GGUF dims (a leading expert axis (E, rows, cols) is kept).

    Returns a QWeight (float32 scales) for quantized types, a dense tensor for F32/F16/BF16.
    """
    qtype = _ggml_type(ggml_type)
    shape = tuple(int(s) for s in shape)
    name = qtype.name
    if name in DENSE_TYPES:
        return _dense(raw, qtype, shape)
    if name not in LOSSLESS_TYPES + REQUANTIZED_TYPES:
        raise ValueError(f"ggml type {name} is not supported; supported: {LOSSLESS_TYPES + REQUANTIZED_TYPES + DENSE_TYPES}")
    if len(shape) > 3:
        raise ValueError(f"shape {shape}: QWeight holds (rows, cols) or (experts, rows, cols)")
    blocks = _blocks(raw, qtype, shape)
    if name in _AFFINE_REPACKS:
        codes, bits, scale, bias = _AFFINE_REPACKS[name](blocks)
        groups_per_row = shape[-1] // 32
        scales = np.asarray(scale, np.float32).reshape(shape[:-1] + (groups_per_row,))
        biases = np.asarray(bias, np.float32).reshape(shape[:-1] + (groups_per_row,))
        packed = pack_bits(codes.reshape(shape), bits)
        return QWeight(packed, scales, biases, format=QuantFormat("affine", bits, 32))
    if name in ("MXFP4", "NVFP4"):
        codes, scale_codes = (_mxfp4 if name == "MXFP4" else _nvfp4)(blocks)
        mode = name.lower()
        fmt = QuantFormat.resolve(mode)
        scale_codes = np.ascontiguousarray(scale_codes).reshape(shape[:-1] + (shape[-1] // fmt.group_size,))
        packed = pack_bits(codes.reshape(shape), 4)
        return QWeight(packed, scale_codes, None, format=fmt, dtype=torch.float32)
    # Requantize: gguf's own float32 dequantization, then min/max affine 8-bit groups of 32.
    dense = gguf_quants.dequantize(blocks.reshape(-1), qtype).reshape(shape)
    packed, scales, biases = minmax_affine_quantize(dense, bits=REQUANT_BITS, group_size=32)
    return QWeight(packed, scales, biases, format=QuantFormat("affine", REQUANT_BITS, 32))


def minmax_affine_quantize(w: np.ndarray, bits: int, group_size: int):
    """Affine quantization with bias = group min and scale = range / (2**bits - 1).

    Same stored format as MLX affine, but not MLX's choice of scale: MLX makes the
    larger-magnitude edge exact, which can push the other edge up to one full step out
    of range (then clipped); here the error is at most half a step, range / (2*(2**bits-1)),
    plus float32 rounding of q*scale + bias.
    """
    groups = np.asarray(w, np.float32).reshape(w.shape[:-1] + (w.shape[-1] // group_size, group_size))
    lo, hi = groups.min(axis=-1), groups.max(axis=-1)
    n_bins = np.float32((1 << bits) - 1)
    scale = ((hi - lo) / n_bins).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))  # constant group: every code 0, value = bias
    q = np.clip(np.rint((groups - lo[..., None]) / safe[..., None]), 0, n_bins).astype(np.uint8)
    return pack_bits(q.reshape(w.shape), bits), scale, lo.astype(np.float32)
