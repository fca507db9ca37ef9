"""Every IR op, defined once with all its faces side by side.

An `OpDef` gives, for one op: `infer` (result dtype from source dtypes), `reference` (numpy; this IS
the op's meaning), `triton` and `numba` (source-expression templates over the sources' names).
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
    numba: Callable[..., str]          # (src exprs...) -> numba/numpy expression


OPS: dict[str, OpDef] = {}

STRUCTURAL = {"param", "dim", "const", "arange", "full", "program_id", "cast", "bitcast", "load", "store",
              "atomic_add", "range", "var", "assign", "reshape", "expand", "broadcast", "trans",
              "reduce", "dot", "where", "stride"}


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
