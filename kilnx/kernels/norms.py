"""Normalisation fusions: RMSNorm, residual-add + RMSNorm, gemma-style (1 + w) weights, LayerNorm.

Each is one `@kd.fusion`; math in fp32, results in the input's dtype.
"""

from __future__ import annotations

import kilnx.dsl as kd
from kilnx.kernels._tuning import row_problems, rows_args


@kd.fusion
def rms_norm_kernel(x, w, *, eps: float = 1e-6, offset: float = 0.0):
    h = x.f32()
    y = h * kd.rsqrt(kd.mean(h * h, axis=-1, keepdims=True) + eps) * (offset + w.f32())
    return y.astype(x.dtype)


@kd.fusion
def add_rms_norm_kernel(x, res, w, *, eps: float = 1e-6, offset: float = 0.0):
    h = x.f32() + res.f32()
    y = h * kd.rsqrt(kd.mean(h * h, axis=-1, keepdims=True) + eps) * (offset + w.f32())
    return h.astype(x.dtype), y.astype(x.dtype)


@kd.fusion
def layer_norm_kernel(x, w, b, *, eps: float = 1e-5):
    h = x.f32()
    mu = kd.mean(h, axis=-1, keepdims=True)
    d = h - mu
    y = d * kd.rsqrt(kd.mean(d * d, axis=-1, keepdims=True) + eps) * w.f32() + b.f32()
    return y.astype(x.dtype)


def rms_norm(x, w, eps, *, weight_offset=0.0):
    return rms_norm_kernel(x, w, eps=float(eps), offset=float(weight_offset))


def add_rms_norm(x, residual, w, eps, *, weight_offset=0.0):
    return add_rms_norm_kernel(x, residual, w, eps=float(eps), offset=float(weight_offset))


def layer_norm(x, w, b, eps):
    return layer_norm_kernel(x, w, b, eps=float(eps))


rms_norm_kernel.tuning(make_args=rows_args(n_rows_inputs=1, n_vectors=1),
                       problems=row_problems())
add_rms_norm_kernel.tuning(make_args=rows_args(n_rows_inputs=2, n_vectors=1),
                           problems=row_problems())
layer_norm_kernel.tuning(make_args=rows_args(n_rows_inputs=1, n_vectors=2),
                         problems=row_problems())
