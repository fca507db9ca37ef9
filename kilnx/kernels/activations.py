"""Activation fusions: SwiGLU and GeGLU over a fused [gate | up] row, squared ReLU (nemotron-h's ungated MLP),
logit softcap, scaled residual add, and argmax over the vocabulary."""

from __future__ import annotations

import kilnx.dsl as kd
from kilnx.kernels._tuning import row_problems, rows_args


@kd.fusion
def silu_mul_kernel(gate_up):
    gate, up = kd.split(gate_up, 2)
    return (kd.silu(gate.f32()) * up.f32()).astype(gate_up.dtype)


@kd.fusion
def gelu_tanh_mul_kernel(gate_up):
    gate, up = kd.split(gate_up, 2)
    return (kd.gelu_tanh(gate.f32()) * up.f32()).astype(gate_up.dtype)


@kd.fusion
def relu2_kernel(x):
    h = kd.maximum(x.f32(), 0.0)
    return (h * h).astype(x.dtype)


@kd.fusion
def softcap_kernel(x, *, cap: float = 30.0):
    return (cap * kd.tanh(x.f32() / cap)).astype(x.dtype)


@kd.fusion
def scaled_add_kernel(x, res, *, scale: float = 1.0):
    return (res.f32() + scale * x.f32()).astype(x.dtype)


@kd.fusion
def argmax_kernel(x):
    return kd.argmax(x.f32(), axis=-1)


def silu_mul(gate_up):
    return silu_mul_kernel(gate_up)


def gelu_tanh_mul(gate_up):
    return gelu_tanh_mul_kernel(gate_up)


def relu2(x):
    return relu2_kernel(x)


def softcap(x, cap):
    return softcap_kernel(x, cap=float(cap))


def scaled_add(x, residual, scale):
    return scaled_add_kernel(x, residual, scale=float(scale))


def argmax(logits):
    return argmax_kernel(logits).long()


silu_mul_kernel.tuning(make_args=rows_args(n_rows_inputs=1, n_vectors=0, width_factor=2),
                       problems=row_problems(widths=(14336,)))
relu2_kernel.tuning(make_args=rows_args(n_rows_inputs=1, n_vectors=0), problems=row_problems(widths=(21504,)))
gelu_tanh_mul_kernel.tuning(make_args=rows_args(n_rows_inputs=1, n_vectors=0, width_factor=2),
                            problems=row_problems(widths=(14336,)))
softcap_kernel.tuning(make_args=rows_args(n_rows_inputs=1, n_vectors=0),
                      problems=row_problems(widths=(32000,), rows=(1, 16)))
scaled_add_kernel.tuning(make_args=rows_args(n_rows_inputs=2, n_vectors=0),
                         problems=row_problems(widths=(4096,)))
argmax_kernel.tuning(make_args=rows_args(n_rows_inputs=1, n_vectors=0),
                     problems=row_problems(widths=(128256,), rows=(1, 16)))
