"""qmv_tc (the few-row GEMV on tensor cores) = MLX's quantized_matmul for 16-bit activations.

Its products and sums are fp32 (codes + a magic offset are exact 16-bit values, the offset is folded
into the bias), so it is held to the bound of the dense product of the same bf16/fp16 operands.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import qmv_tc as T

pytest.importorskip("mlx.core")   # the reference (mlx_cases.py)
from mlx_cases import mlx_case  # noqa: E402
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")


def check(got, want, x, qw):
    assert got.shape == want.shape and got.dtype == x.dtype
    k = x.shape[1]
    wmax = qw.dequantize(torch.float32).abs().max().item()
    # the output's own rounding plus fp32-accumulation slack over K terms
    tol = 2 ** -7 * want.abs().max().item() + 1e-6 * k * wmax * x.float().abs().max().item()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol, f"max error {err} > {tol}"


@interpreted
@settings(max_examples=8, deadline=None, derandomize=True)
@given(bits=st.sampled_from([2, 4, 8]), gs=st.sampled_from([32, 64]), m=st.sampled_from([1, 2, 3, 8, 16, 17]),
       n=st.sampled_from([7, 40]), groups=st.sampled_from([1, 3]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), swap=st.booleans(), split_k=st.sampled_from([1, 2]))
def test_qmv_tc_matches_mlx_on_the_interpreter(bits, gs, m, n, groups, dtype, swap, split_k):
    """N and K off the block sizes, rows past 16 (a 32-row tile), both operand orders, split-K."""
    x, qw, want = mlx_case(m, n, gs * groups, bits, gs, seed=bits * 100 + m * 10 + n, x_dtype=dtype)
    s, b = qw.scales.to(dtype), qw.biases.to(dtype)
    got = T.run_qmv_tc(x, qw.packed, s, b, backend="triton",
                       config={"BLOCK_N": 32, "SWAP": swap, "SPLIT_K": split_k, "STAGES": 1})
    # MLX's own weights in x's dtype: compare with the product of exactly those
    from kilnx.kernels.qmatmul import _dense_spec
    check(got, _dense_spec(x.float(), qw.packed, s, b, bits, gs, dtype=torch.float32), x, qw)
    assert (got.float() - want).abs().max() <= 0.05 * want.abs().max()    # and MLX's fp32 scales, loosely


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("bits,dtype", [(4, torch.bfloat16), (8, torch.bfloat16), (4, torch.float16)])
def test_qmv_tc_other_backends(backend, bits, dtype):
    x, qw, _ = mlx_case(5, 24, 256, bits, 64, seed=5, x_dtype=dtype)
    s, b = qw.scales.to(dtype), qw.biases.to(dtype)
    from kilnx.kernels.qmatmul import _dense_spec
    got = T.run_qmv_tc(x, qw.packed, s, b, backend=backend, config={"BLOCK_N": 16, "SPLIT_K": 2})
    check(got, _dense_spec(x.float(), qw.packed, s, b, bits, 64, dtype=torch.float32), x, qw)


def test_qmv_tc_refuses_what_it_does_not_serve():
    x, qw, _ = mlx_case(2, 16, 64, 4, 64, seed=1, x_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16/fp16"):
        T.run_qmv_tc(x.float(), qw.packed, qw.scales, qw.biases)
    with pytest.raises(ValueError, match="at most 64 rows"):
        T.run_qmv_tc(x.repeat(40, 1), qw.packed, qw.scales.bfloat16(), qw.biases.bfloat16())
