"""kernels/dense_mm.dense_gemv: a few activation rows against an unquantized weight (nemotron-3's fp32 router at
decode), x @ w.T with fp32 sums, equal to the float64 product on every backend, over shapes and configs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import dense_mm as D
from kilnx.kernels import qmatmul as Q


def close(got, x, w, dtype):
    want = x.double() @ w.double().T
    assert got.dtype == dtype and got.shape == want.shape
    # fp32 sums in another order; a bf16 output is rounded once (8 bits)
    tol = (1e-5 if dtype == torch.float32 else 8e-3) * float(want.abs().max()) + 1e-5 * x.shape[1] ** 0.5
    assert (got.double() - want).abs().max().item() <= tol


@settings(max_examples=10, deadline=None, derandomize=True)
@given(m=st.integers(1, 16), n=st.integers(1, 40), k=st.sampled_from([16, 96, 200, 256]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       cfg=st.sampled_from([None, {"BLOCK_N": 1, "BLOCK_K": 64}, {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 2},
                            {"BLOCK_N": 4, "BLOCK_K": 256, "num_stages": 1}]))
def test_gemv_is_the_float64_product(m, n, k, dtype, cfg):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    for backend in ("triton", "reference", "numba"):
        close(D.dense_gemv(x, w, backend=backend, config=cfg), x, w, dtype)


def test_the_default_covers_the_router_and_wide_weights():
    """One program per row of a narrow weight (the router's 128), four of a wide one; K chunks within ~8k
    products a program, never past the next power of two of K."""
    for m, n, k in [(1, 128, 2688), (4, 4096, 4096), (16, 4096, 4096), (1, 40, 48)]:
        x, w = torch.zeros(m, k), torch.zeros(n, k)
        cfg = D.dense_gemv.default_config(x, w)
        assert cfg["BLOCK_N"] == (1 if n < 1024 else 4)
        assert 32 <= cfg["BLOCK_K"] <= max(32, 1 << (k - 1).bit_length())
        assert D.pow2_at_least(m) * cfg["BLOCK_N"] * cfg["BLOCK_K"] <= 8192 or cfg["BLOCK_K"] == 32


def test_qmatmul_takes_it_for_few_rows_on_the_gpu_only():
    """A dense weight's qmatmul: gemv for 1-16 rows on the GPU; mm otherwise (numba's on the CPU)."""
    class Cuda:     # a stand-in with a GPU tensor's answers
        is_cuda = True

        def __init__(self, rows):
            self.shape = (rows, 64)
    assert D.takes_dense_gemv(Cuda(1)) and D.takes_dense_gemv(Cuda(16))
    assert not D.takes_dense_gemv(Cuda(17)) and not D.takes_dense_gemv(Cuda(0))
    assert not D.takes_dense_gemv(torch.zeros(1, 64))
    x, w = torch.randn(3, 64), torch.randn(5, 64)
    close(Q.qmatmul(x, w), x, w, torch.float32)


@pytest.mark.gpu
def test_gemv_on_the_gpu_through_qmatmul():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 4, 16):
            x = torch.randn(m, 2688, device="cuda").to(dtype)
            w = torch.randn(128, 2688, device="cuda").to(dtype) * 0.02
            close(Q.qmatmul(x, w).cpu(), x.cpu(), w.cpu(), dtype)
