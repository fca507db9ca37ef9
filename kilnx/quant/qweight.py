"""QWeight: a quantized weight matrix (or a stack of per-expert matrices) in MLX's layout.

Storage (all torch tensors, on one device):
  packed        torch.int32 (..., N, K*bits/32). The words are MLX's uint32 words; int32
                is only the container because torch has no shifts/bitwise ops on uint32
                (`packed.view(torch.uint32)` recovers the unsigned view bit for bit).
  scales        affine: float32/float16/bfloat16 (..., N, K/group_size);
                mxfp4/mxfp8: uint8 e8m0 exponent codes; nvfp4: uint8 e4m3 codes.
  biases        affine only, same dtype and shape as scales; None for the fp modes.
  global_scale  nvfp4 only, optional float32 scalar tensor (MLX's `global_scale`).

The leading "..." is empty or one expert axis E. The numpy references in mlx_formats.py
define what the bits mean; `dequantize` evaluates them (on CPU) and returns the result
on the weight's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import mlx_formats as mf

_TORCH_FLOAT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_FLOAT_NAME = {v: k for k, v in _TORCH_FLOAT.items()}
MODES = ("affine",) + tuple(mf.FP_MODES)


@dataclass(frozen=True)
class QuantFormat:
    """What the packed bits mean; hashable, so kernels and caches can key on it."""

    mode: str
    bits: int
    group_size: int

    def __post_init__(self):
        if self.mode == "affine":
            mf.check_affine_params(self.bits, self.group_size)
        elif self.mode in mf.FP_MODES:
            spec = mf.FP_MODES[self.mode]
            if (self.bits, self.group_size) != (spec.bits, spec.group_size):
                raise ValueError(
                    f"mode {self.mode!r} requires bits={spec.bits} and group_size={spec.group_size}, "
                    f"got bits={self.bits}, group_size={self.group_size}; omit them to use the defaults"
                )
        else:
            raise ValueError(f"unknown quantization mode {self.mode!r}; use one of {MODES}")

    @classmethod
    def resolve(cls, mode: str = "affine", bits: int | None = None, group_size: int | None = None) -> "QuantFormat":
        """Fill unspecified bits/group_size with the mode's defaults (affine: 4 bits, groups of 64, as MLX)."""
        if mode == "affine":
            return cls(mode, 4 if bits is None else bits, 64 if group_size is None else group_size)
        if mode in mf.FP_MODES:
            spec = mf.FP_MODES[mode]
            return cls(mode, spec.bits if bits is None else bits, spec.group_size if group_size is None else group_size)
        raise ValueError(f"unknown quantization mode {mode!r}; use one of {MODES}")

    @property
    def has_bias(self) -> bool:
        return self.mode == "affine"

    def packed_cols(self, k: int) -> int:
        return k * self.bits // 32


# ----------------------------------------------------------------------------- conversions


def _to_torch(x, what: str) -> torch.Tensor:
    """numpy / torch / mlx array -> torch tensor (bf16 kept as torch.bfloat16)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if x.dtype == np.uint32:
            x = x.view(np.int32)
        return torch.from_numpy(np.ascontiguousarray(x))
    if type(x).__module__.startswith("mlx"):  # an mx.array; no hard dependency on mlx
        import mlx.core as mx

        if x.dtype == mx.bfloat16:
            return torch.from_numpy(np.array(x.astype(mx.float32))).to(torch.bfloat16)
        return _to_torch(np.array(x), what)
    raise ValueError(f"{what} must be a torch tensor, numpy array or mlx array, got {type(x).__name__}")


def _float_numpy(t: torch.Tensor) -> np.ndarray:
    """Exact float32 numpy copy of a float tensor (bf16/fp16 widen exactly)."""
    return t.detach().to("cpu", torch.float32).numpy()


def _words_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy().view(np.uint32)


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, dtype)
    if dtype not in _FLOAT_NAME:
        raise ValueError(f"unsupported dtype {dtype}; use torch.float32, torch.float16 or torch.bfloat16")
    return _FLOAT_NAME[dtype]


# ----------------------------------------------------------------------------- QWeight


class QWeight:
    """A quantized (N, K) matrix or (E, N, K) expert stack. Build with `from_mlx` or `quantize`."""

    def __init__(self, packed, scales, biases=None, *, format: QuantFormat, global_scale=None, dtype=None):
        fmt = format
        packed = _to_torch(packed, "packed")
        scales = _to_torch(scales, "scales")
        biases = None if biases is None else _to_torch(biases, "biases")
        if packed.dtype == torch.uint32:
            packed = packed.view(torch.int32)
        if packed.dtype != torch.int32:
            raise ValueError(f"packed must hold uint32 words (uint32 or int32 dtype), got {packed.dtype}")
        if packed.dim() not in (2, 3):
            raise ValueError(
                f"packed must be (N, K*bits/32) or (E, N, K*bits/32), got shape {tuple(packed.shape)}"
            )
        if (packed.shape[-1] * 32) % fmt.bits:
            raise ValueError(f"packed has {packed.shape[-1]} words per row, not a whole number of {fmt.bits}-bit values")
        k = packed.shape[-1] * 32 // fmt.bits
        if k % fmt.group_size:
            raise ValueError(f"K={k} (from packed) is not a multiple of group_size={fmt.group_size}")
        want = tuple(packed.shape[:-1]) + (k // fmt.group_size,)
        if tuple(scales.shape) != want:
            raise ValueError(
                f"scales shape {tuple(scales.shape)} does not match packed {tuple(packed.shape)}: expected {want} "
                f"for {fmt.bits}-bit values in groups of {fmt.group_size} (check bits/group_size)"
            )
        if fmt.has_bias:
            if scales.dtype not in _FLOAT_NAME:
                raise ValueError(f"affine scales must be float32/float16/bfloat16, got {scales.dtype}")
            if biases is None:
                raise ValueError("affine mode needs biases (MLX's third quantize output); pass biases=")
            if tuple(biases.shape) != want or biases.dtype != scales.dtype:
                raise ValueError(
                    f"biases must match scales: shape {want}, dtype {scales.dtype}; "
                    f"got shape {tuple(biases.shape)}, dtype {biases.dtype}"
                )
            if dtype is not None and _dtype_name(dtype) != _FLOAT_NAME[scales.dtype]:
                raise ValueError("affine QWeight computes in its scales dtype; cast scales/biases instead of passing dtype")
            dtype = scales.dtype
        else:
            if biases is not None:
                raise ValueError(f"mode {fmt.mode!r} has no biases; pass biases=None")
            if scales.dtype != torch.uint8:
                raise ValueError(f"{fmt.mode} scales must be uint8 codes (as mx.quantize returns), got {scales.dtype}")
            # MLX dequantizes fp modes to bfloat16 unless told otherwise.
            dtype = torch.bfloat16 if dtype is None else _TORCH_FLOAT[_dtype_name(dtype)]
        if global_scale is not None:
            if fmt.mode != "nvfp4":
                raise ValueError(f"global_scale is only meaningful for nvfp4, not {fmt.mode!r}")
            global_scale = _to_torch(global_scale, "global_scale")
            if global_scale.numel() != 1 or global_scale.dtype != torch.float32:
                raise ValueError("global_scale must be a single float32 value (as MLX requires)")
            global_scale = global_scale.reshape(())
        devices = {t.device for t in (packed, scales, biases, global_scale) if t is not None}
        if len(devices) != 1:
            raise ValueError(f"packed/scales/biases live on different devices {devices}; move them together")
        self.packed = packed
        self.scales = scales
        self.biases = biases
        self.global_scale = global_scale
        self.format = fmt
        self.dtype = dtype

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_mlx(cls, packed, scales, biases=None, *, mode="affine", bits=None, group_size=None,
                 global_scale=None, dtype=None) -> "QWeight":
        """Wrap the outputs of `mx.quantize` (torch, numpy or mlx arrays).

        bits/group_size default to the mode's MLX defaults (affine: 4 and 64). For the
        fp modes `dtype` is the dequantization dtype (default bfloat16, as in MLX).
        """
        return cls(packed, scales, biases, format=QuantFormat.resolve(mode, bits, group_size),
                   global_scale=global_scale, dtype=dtype)

    @classmethod
    def quantize(cls, w, *, mode="affine", bits=None, group_size=None, global_scale=None) -> "QWeight":
        """Quantize a dense (N, K) or (E, N, K) float tensor, bit-exact with `mx.quantize`."""
        fmt = QuantFormat.resolve(mode, bits, group_size)
        w = _to_torch(w, "w")
        if w.dim() not in (2, 3):
            raise ValueError(f"w must be (N, K) or (E, N, K), got shape {tuple(w.shape)}")
        if w.dtype not in _FLOAT_NAME:
            raise ValueError(f"w must be float32/float16/bfloat16, got {w.dtype}")
        if w.shape[-1] % fmt.group_size:
            raise ValueError(f"K={w.shape[-1]} is not a multiple of group_size={fmt.group_size}; pad K or change it")
        name = _FLOAT_NAME[w.dtype]
        values = _float_numpy(w)
        if fmt.mode == "affine":
            packed, scales, biases = mf.affine_quantize(values, fmt.group_size, fmt.bits, dtype=name)
            scales_t = torch.from_numpy(scales).to(w.dtype)
            biases_t = torch.from_numpy(biases).to(w.dtype)
        else:
            gs = None if global_scale is None else float(np.float32(_float_numpy(_to_torch(global_scale, "global_scale")).reshape(())))
            packed, codes = mf.fp_quantize(values, fmt.mode, dtype=name, global_scale=gs)
            scales_t, biases_t = torch.from_numpy(codes), None
            if global_scale is not None:
                global_scale = torch.tensor(gs, dtype=torch.float32)
        q = cls(torch.from_numpy(packed.view(np.int32)), scales_t, biases_t, format=fmt,
                global_scale=global_scale, dtype=None if fmt.mode == "affine" else w.dtype)
        return q.to(w.device)

    # -- views ------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self.format.mode

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def group_size(self) -> int:
        return self.format.group_size

    @property
    def shape(self) -> tuple:
        """Logical shape of the dense weight: (N, K) or (E, N, K)."""
        return tuple(self.packed.shape[:-1]) + (self.packed.shape[-1] * 32 // self.bits,)

    @property
    def num_experts(self) -> int | None:
        return self.packed.shape[0] if self.packed.dim() == 3 else None

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        """Bytes held by packed + scales + biases (+ global scale)."""
        tensors = (self.packed, self.scales, self.biases, self.global_scale)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _replace(self, **tensors) -> "QWeight":
        fields = dict(packed=self.packed, scales=self.scales, biases=self.biases, global_scale=self.global_scale)
        fields.update(tensors)
        return QWeight(fields["packed"], fields["scales"], fields["biases"], format=self.format,
                       global_scale=fields["global_scale"], dtype=None if self.format.has_bias else self.dtype)

    def to(self, device) -> "QWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return self._replace(packed=move(self.packed), scales=move(self.scales), biases=move(self.biases),
                             global_scale=move(self.global_scale))

    def widened(self, bits: int) -> "QWeight":
        """The same codes, scales and biases with codes packed `bits` wide (2, 4 or 8, more than now): an
        affine weight whose width the GEMVs cannot read (3, 5, 6) in one they can, exactly (dequantize is
        unchanged), at bits / self.bits times the packed bytes."""
        from .bitpack import repack_words
        if self.mode != "affine" or bits <= self.bits:
            raise ValueError(f"widened: an affine weight to more bits, not {self.mode} {self.bits}-bit to {bits}")
        return QWeight(repack_words(self.packed, self.bits, bits), self.scales, self.biases,
                       format=QuantFormat("affine", bits, self.group_size))

    def __getitem__(self, expert) -> "QWeight":
        """Select experts from an (E, N, K) stack: an int gives (N, K), a slice (E', N, K)."""
        if self.packed.dim() != 3:
            raise ValueError(f"indexing selects experts, but this QWeight is a single matrix {self.shape}")
        if not isinstance(expert, (int, slice)):
            raise ValueError(f"index experts with an int or a slice, got {type(expert).__name__}")
        if isinstance(expert, int) and not -self.packed.shape[0] <= expert < self.packed.shape[0]:
            raise IndexError(f"expert {expert} out of range for {self.packed.shape[0]} experts")
        pick = lambda t: None if t is None else t[expert]  # noqa: E731
        return self._replace(packed=pick(self.packed), scales=pick(self.scales), biases=pick(self.biases))

    def __len__(self) -> int:
        return self.packed.shape[0]

    # -- dequantization ---------------------------------------------------------------

    def dequantize(self, dtype=None) -> torch.Tensor:
        """Dense weight, equal to `mx.dequantize` of the same arrays.

        affine: computed in the scales dtype exactly as MLX does, then cast to `dtype`
        (default: the scales dtype). fp modes: computed in `dtype` (default self.dtype),
        as MLX's `dtype=` argument does; with an nvfp4 global scale MLX's arithmetic is
        float32 and the result is cast to `dtype` at the end.
        """
        out_dtype = self.dtype if dtype is None else _TORCH_FLOAT[_dtype_name(dtype)]
        words = _words_numpy(self.packed)
        if self.mode == "affine":
            values = mf.affine_dequantize(words, _float_numpy(self.scales), _float_numpy(self.biases),
                                          self.group_size, self.bits, dtype=_FLOAT_NAME[self.scales.dtype])
        else:
            gs = None if self.global_scale is None else float(self.global_scale.cpu())
            values = mf.fp_dequantize(words, self.scales.cpu().numpy(), self.mode,
                                      dtype=_FLOAT_NAME[out_dtype], global_scale=gs)
        return torch.from_numpy(values).to(device=self.device, dtype=out_dtype)

    def __repr__(self) -> str:
        extra = "" if self.global_scale is None else ", global_scale"
        return (f"QWeight(shape={self.shape}, mode={self.mode!r}, bits={self.bits}, group_size={self.group_size}, "
                f"dtype={self.dtype}, device={self.device}{extra})")
