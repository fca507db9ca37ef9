"""Every IR op, defined once with all its faces side by side.

An `OpDef` gives, for one op: `infer` (result dtype from source dtypes), `reference` (numpy; this IS
the op's meaning), `triton` and `numba` (source-expression templates over the sources' names; the
numba lowering loops over tile elements, so its template sees and returns scalars).
Structural ops (load, store, range, var, ...) are handled by each backend directly; they are listed
in `STRUCTURAL` so a backend can check it covers every op.

To add an op: register it here, add its user-facing function in `kilnx/dsl/lang.py`, and a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .ir import is_float, promote


@dataclass(frozen=True)
class OpDef:
    name: str
    arity: int
    infer: Callable[..., str]          # (src dtypes...) -> result dtype
    reference: Callable[..., np.ndarray]
    triton: Callable[..., str]         # (src exprs...) -> Triton expression
    numba: Callable[..., str]          # (one element of each src...) -> numba scalar expression


OPS: dict[str, OpDef] = {}

STRUCTURAL = {"param", "dim", "const", "arange", "full", "program_id", "cast", "bitcast", "load", "store",
              "atomic_add", "range", "var", "assign", "reshape", "expand", "broadcast", "trans", "permute", "join",
              "nibbles", "reduce", "dot", "where", "stride", "prefetch", "grid_sync", "barrier",
              "launch_deps"}


def register(name, arity, infer, reference, triton, numba):
    OPS[name] = OpDef(name, arity, infer, reference, triton, numba)


def _same(*ds):
    out = ds[0]
    for d in ds[1:]:
        out = promote(out, d)
    return out


def _float_of(*ds):
    d = _same(*ds)
    return d if is_float(d) else "f32"


def _bool(*ds):
    return "bool"


# Unary float math. Triton has no tanh in its core language on every version we support, so tanh
# is expressed through sigmoid at trace time (see lang.tanh); erf is a primitive here.
register("exp", 1, _float_of, np.exp, lambda a: f"tl.exp({a})", lambda a: f"np.exp({a})")
register("log", 1, _float_of, np.log, lambda a: f"tl.log({a})", lambda a: f"np.log({a})")
register("sqrt", 1, _float_of, np.sqrt, lambda a: f"tl.sqrt({a})", lambda a: f"np.sqrt({a})")
register("rsqrt", 1, _float_of, lambda a: 1.0 / np.sqrt(a), lambda a: f"tl.rsqrt({a})",
         lambda a: f"(1.0 / np.sqrt({a}))")
register("sigmoid", 1, _float_of, lambda a: 1.0 / (1.0 + np.exp(-a)), lambda a: f"tl.sigmoid({a})",
         lambda a: f"(1.0 / (1.0 + np.exp(-({a}))))")
register("erf", 1, _float_of, lambda a: _np_erf(a), lambda a: f"tl.erf({a})", lambda a: f"_rt.erf({a})")
register("cos", 1, _float_of, np.cos, lambda a: f"tl.cos({a})", lambda a: f"np.cos({a})")
register("sin", 1, _float_of, np.sin, lambda a: f"tl.sin({a})", lambda a: f"np.sin({a})")
register("abs", 1, _same, np.abs, lambda a: f"tl.abs({a})", lambda a: f"np.abs({a})")
register("neg", 1, _same, np.negative, lambda a: f"(-{a})", lambda a: f"(-{a})")
register("invert", 1, _same, np.invert, lambda a: f"(~{a})", lambda a: f"(~{a})")

# Binary arithmetic and comparison. Integer // and % assume non-negative operands (Triton uses C
# truncation, numpy floors; they agree there).
for _name, _sym, _np in [("add", "+", np.add), ("sub", "-", np.subtract), ("mul", "*", np.multiply),
                         ("floordiv", "//", np.floor_divide), ("mod", "%", np.remainder),
                         ("and", "&", np.bitwise_and), ("or", "|", np.bitwise_or),
                         ("xor", "^", np.bitwise_xor), ("shl", "<<", np.left_shift),
                         ("shr", ">>", np.right_shift)]:
    register(_name, 2, _same, _np, (lambda s: lambda a, b: f"({a} {s} {b})")(_sym),
             (lambda s: lambda a, b: f"({a} {s} {b})")(_sym))
register("truediv", 2, _float_of, np.true_divide, lambda a, b: f"({a} / {b})", lambda a, b: f"({a} / {b})")
for _name, _sym, _np in [("lt", "<", np.less), ("le", "<=", np.less_equal), ("gt", ">", np.greater),
                         ("ge", ">=", np.greater_equal), ("eq", "==", np.equal), ("ne", "!=", np.not_equal)]:
    register(_name, 2, _bool, _np, (lambda s: lambda a, b: f"({a} {s} {b})")(_sym),
             (lambda s: lambda a, b: f"({a} {s} {b})")(_sym))
register("maximum", 2, _same, np.maximum, lambda a, b: f"tl.maximum({a}, {b})",
         lambda a, b: f"np.maximum({a}, {b})")
register("minimum", 2, _same, np.minimum, lambda a, b: f"tl.minimum({a}, {b})",
         lambda a, b: f"np.minimum({a}, {b})")


def _np_erf(a):
    import torch
    return torch.special.erf(torch.from_numpy(np.asarray(a, dtype=np.float64))).numpy().astype(
        np.asarray(a).dtype)


# Reductions: one op "reduce" with arg (kind, axis, keepdims). Neutral elements for masking.
REDUCE_KINDS = ("sum", "max", "min", "argmax", "argmin")


def reduce_reference(kind: str, x: np.ndarray, axis: int, keepdims: bool) -> np.ndarray:
    if kind == "sum":
        return np.sum(x, axis=axis, keepdims=keepdims, dtype=x.dtype)
    if kind == "max":
        return np.max(x, axis=axis, keepdims=keepdims)
    if kind == "min":
        return np.min(x, axis=axis, keepdims=keepdims)
    f = np.argmax if kind == "argmax" else np.argmin
    r = f(x, axis=axis).astype(np.int32)
    return np.expand_dims(r, axis) if keepdims else r


def reduce_dtype(kind: str, d: str) -> str:
    return "i32" if kind in ("argmax", "argmin") else d


# Packed half2: a u32 holds two fp16 values, the low 16 bits first. Dequantization and dot products
# in this form do two codes per instruction (HFMA2), where fp32 math does one; the GEMV is
# instruction-bound in fp32 (kilnx/kernels/qmv_h2.py). Each op's reference is bit-exact with the
# GPU's instruction: one rounding to fp16 per fma (round to nearest even), sums in fp32.
def _h2_split(a):
    a = np.asarray(a).astype(np.uint32)
    lo = (a & 0xFFFF).astype(np.uint16).view(np.float16)
    hi = (a >> 16).astype(np.uint16).view(np.float16)
    return lo.astype(np.float64), hi.astype(np.float64)


def _h2_join(lo, hi):
    lo = np.asarray(lo, np.float64).astype(np.float16).view(np.uint16).astype(np.uint32)
    hi = np.asarray(hi, np.float64).astype(np.float16).view(np.uint16).astype(np.uint32)
    return lo | (hi << 16)


def _h2_fma_reference(a, b, c):
    # products of fp16 values are exact in float64, and so is their sum with an fp16 value (the lost
    # bits lie below any fp16 rounding decision): one rounding, as fma.rn.f16x2
    (al, ah), (bl, bh), (cl, ch) = _h2_split(a), _h2_split(b), _h2_split(c)
    return _h2_join(al * bl + cl, ah * bh + ch)


def _h2_sum_reference(a):
    lo, hi = _h2_split(a)
    return lo.astype(np.float32) + hi.astype(np.float32)


def _u32(*_):
    return "u32"


register("h2_pack", 2, _u32, lambda lo, hi: _h2_join(np.asarray(lo, np.float32), np.asarray(hi, np.float32)),
         lambda lo, hi: f"_rt.h2_pack({lo}, {hi})", lambda lo, hi: f"_rt.h2_pack({lo}, {hi})")
register("h2_fma", 3, _u32, _h2_fma_reference,
         lambda a, b, c: f"_rt.h2_fma({a}, {b}, {c})", lambda a, b, c: f"_rt.h2_fma({a}, {b}, {c})")
register("h2_sum", 1, lambda *_: "f32", _h2_sum_reference,
         lambda a: f"_rt.h2_sum({a})", lambda a: f"_rt.h2_sum({a})")


# Packed bf16 pairs and byte permutes: a 4-bit code pair decoded straight into the two bf16 halves of a
# u32 (two elements of a tensor-core operand per instruction; kernels/qmatmul.py's packed decode).
def _bf16_of_bits(u):
    return (np.asarray(u).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _bf16_bits_of(x):
    """float64 -> bf16 bits, nearest even, one rounding: the float64's mantissa rounded at bf16's 8
    significant bits (normal values; kernels stay far from bf16's range limits)."""
    b = np.asarray(x, np.float64).view(np.uint64)
    b = (b + np.uint64((1 << 44) - 1) + ((b >> np.uint64(45)) & np.uint64(1))) & ~np.uint64((1 << 45) - 1)
    return (b.view(np.float64).astype(np.float32).view(np.uint32) >> 16).astype(np.uint32)


def _bf2_fma_reference(a, b, c):
    # bf16 products are exact in float64 and so is their sum with a bf16 value: one rounding, as
    # fma.rn.bf16x2
    a, b, c = (np.asarray(v).astype(np.uint32) for v in (a, b, c))
    lo = _bf16_of_bits(a & 0xFFFF) * _bf16_of_bits(b & 0xFFFF) + _bf16_of_bits(c & 0xFFFF)
    hi = _bf16_of_bits(a >> 16) * _bf16_of_bits(b >> 16) + _bf16_of_bits(c >> 16)
    return _bf16_bits_of(lo) | (_bf16_bits_of(hi) << 16)


def _byte_perm_reference(a, b, sel):
    """PTX prmt.b32 (default mode): output byte i is byte (sel >> 4i) & 7 of the 8 bytes {b:a} (a's
    bytes 0-3, b's 4-7); with bit 3 of that nibble set, the chosen byte's sign bit is replicated."""
    a, b, sel = (np.asarray(v).astype(np.uint64) for v in (a, b, sel))
    both = a | (b << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, sel).shape, np.uint64)
    for i in range(4):
        nib = (sel >> np.uint64(4 * i)) & np.uint64(15)
        byte = (both >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(nib & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
        out |= byte << np.uint64(8 * i)
    return out.astype(np.uint32)


register("bf2_fma", 3, _u32, _bf2_fma_reference,
         lambda a, b, c: f"_rt.bf2_fma({a}, {b}, {c})", lambda a, b, c: f"_rt.bf2_fma({a}, {b}, {c})")
register("bf2_half", 2, lambda *_: "bf16",
         lambda x, h: _bf16_of_bits((np.asarray(x).astype(np.uint32) >> (16 * np.asarray(h).astype(np.uint32)))
                                    & 0xFFFF).astype(np.float32),
         lambda x, h: f"_rt.bf2_half({x}, {h})", lambda x, h: f"_rt.bf2_half({x}, {h})")
register("byte_perm", 3, _u32, _byte_perm_reference,
         lambda a, b, s: f"_rt.byte_perm({a}, {b}, {s})", lambda a, b, s: f"_rt.byte_perm({a}, {b}, {s})")


def nibbles_reference(byt, scale=None, bias=None):
    """kd.nibbles: (..., 2) fp32 holding bf16 values: 128 + q, or q * scale + bias rounded to bf16 once."""
    byt = np.asarray(byt).astype(np.uint32)
    q = np.stack([byt & 15, byt >> 4], axis=-1).astype(np.float64)
    if scale is None:
        return (128.0 + q).astype(np.float32)
    v = q * np.asarray(scale, np.float64)[..., None] + np.asarray(bias, np.float64)[..., None]
    return _bf16_of_bits(_bf16_bits_of(v)).astype(np.float32)
