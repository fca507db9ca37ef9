"""Elementwise functions and reductions of the kernel language (kd.exp, kd.maximum, kd.sum, kd.silu, ...), each
built from lang's primitive ops; lang re-exports them, so kernel authors see them as kd.*."""

from __future__ import annotations

from kilnx.dsl.lang import Value, _binary, _state, _unary, dsl_error, lift, reduce, where


def _ufunc(op):
    def f(x):
        return _unary(op, x)
    f.__name__ = op
    return f


exp, log, sqrt, rsqrt, sigmoid, erf = (_ufunc(o) for o in ("exp", "log", "sqrt", "rsqrt", "sigmoid", "erf"))
abs = _ufunc("abs")  # noqa: A001
cos, sin = _ufunc("cos"), _ufunc("sin")


def maximum(a, b):
    return _binary("maximum", a, b)


def minimum(a, b):
    return _binary("minimum", a, b)


def sum(x, axis=-1, keepdims=False):  # noqa: A001
    return reduce("sum", x, axis, keepdims)


def max(x, axis=-1, keepdims=False):  # noqa: A001
    return reduce("max", x, axis, keepdims)


def min(x, axis=-1, keepdims=False):  # noqa: A001
    return reduce("min", x, axis, keepdims)


def argmax(x, axis=-1, keepdims=False):
    return reduce("argmax", x, axis, keepdims)


def mean(x, axis=-1, keepdims=False):
    ctx = getattr(_state, "fusion", None)
    if ctx is not None:
        x = x if isinstance(x, Value) else x.value()
        if axis in (-1, x.ndim - 1) and x.ndim == 2:
            return ctx.reduce("sum", x, keepdims, mean=True)
    raise dsl_error("kd.mean is available in @kd.fusion (it knows the row width); in a tile kernel "
                    "divide kd.sum by the runtime size")


# Composite math, expressed in primitives so no backend needs to know them.
def tanh(x):
    x = lift(x)
    return 2.0 * sigmoid(2.0 * x) - 1.0


def silu(x):
    return x * sigmoid(x)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def softplus(x):
    x = lift(x)
    return where(x > 20.0, x, log(1.0 + exp(minimum(x, 20.0))))
