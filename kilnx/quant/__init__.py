"""Quantized weight formats for kilnx: MLX affine / mxfp4 / nvfp4 / mxfp8 and GGUF imports.

Pure data formats with numpy references; the GPU kernels that consume them live elsewhere.
"""

from .gguf_formats import from_gguf
from .mlx_formats import affine_dequantize, affine_quantize, fp_dequantize, fp_quantize
from .qweight import QuantFormat, QWeight


def quantize(w, mode: str = "affine", bits: int | None = None, group_size: int | None = None, global_scale=None):
    """Dense (N, K) / (E, N, K) tensor -> QWeight; same bits as `mx.quantize`."""
    return QWeight.quantize(w, mode=mode, bits=bits, group_size=group_size, global_scale=global_scale)


def dequantize(qweight: QWeight, dtype=None):
    """QWeight -> dense torch tensor; same values as `mx.dequantize`."""
    return qweight.dequantize(dtype)


__all__ = [
    "QWeight",
    "QuantFormat",
    "from_gguf",
    "quantize",
    "dequantize",
    "affine_quantize",
    "affine_dequantize",
    "fp_quantize",
    "fp_dequantize",
]
