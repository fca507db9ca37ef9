"""qmv_h2 (the packed-fp16 GEMV for 4- and 8-bit codes) = MLX's quantized_matmul, within fp16 error.

Its prep kernel is exact (x = fp16 planes x a power of two per group, checked bit for bit); the GEMV
rounds products and 4-term sums to fp16, so it is held to a bound of a few fp16 ulps of each word's
partial sum, summed over K: 2^-10 * sqrt(K) * max|w| * max|x|.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import qmv_h2 as H
from kilnx.quant import QWeight

pytest.importorskip("mlx.core")   # the reference (mlx_cases.py)
from mlx_cases import mlx_case  # noqa: E402
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")


def check(got, want, x, qw):
    k = x.shape[1]
    wmax = qw.dequantize(torch.float32).abs().max().item()
    tol = 2 ** -10 * k ** 0.5 * wmax * x.abs().max().item() + 1e-5
    assert got.shape == want.shape and torch.isfinite(got).all()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol, f"max error {err} > {tol}"


@settings(max_examples=8, deadline=None, derandomize=True)
@given(bits=st.sampled_from([4, 8]), gs=st.sampled_from([32, 64, 128]), m=st.sampled_from([1, 2, 3, 8, 16]),
       n=st.sampled_from([1, 7, 40]), groups=st.sampled_from([1, 3]), x_scale=st.sampled_from([1e-3, 1.0, 3e4]),
       stages=st.sampled_from([1, 3]), chain=st.sampled_from([1, 2, 4]))
def test_qmv_h2_matches_mlx_on_the_interpreter(bits, gs, m, n, groups, x_scale, stages, chain):
    """Any activation range: 3e4 * N(0,1) overflows fp16 unless each group is scaled first. A pipelined
    loop (stages 3) unrolls the activation rows and masks those past M. CHAIN words share an fp16
    accumulator (at most a group's words)."""
    k = gs * groups
    x, qw, want = mlx_case(m, n, k, bits, gs, seed=bits * 100 + m * 10 + n, x_scale=x_scale)
    got = H.run_qmv_h2(x, qw.packed, qw.scales, qw.biases, backend="triton",
                       config={"BLOCK_N": 8, "BLOCK_KW": 64, "SPLIT_K": 1, "STAGES": stages, "CHAIN": chain})
    check(got, want, x, qw)


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("bits,m,split_k,stages,chain", [(4, 1, 1, 1, 1), (8, 3, 2, 1, 2), (4, 3, 1, 1, 4),
                                                        (4, 1, 1, 3, 2), (4, 1, 1, 1, 4)])
def test_qmv_h2_other_backends(backend, bits, m, split_k, stages, chain):
    x, qw, want = mlx_case(m, 24, 256, bits, 64, seed=5)
    got = H.run_qmv_h2(x, qw.packed, qw.scales, qw.biases, backend=backend,
                       config={"BLOCK_N": 8, "BLOCK_KW": 32, "SPLIT_K": split_k, "STAGES": stages, "CHAIN": chain})
    check(got, want, x, qw)


@pytest.mark.parametrize("backend", ["reference", "triton", "numba"])
def test_prep_is_exact_fp16_planes_times_a_power_of_two(backend):
    x = (torch.randn(3, 256) * torch.tensor([1e-4, 1.0, 5e4])[:, None]).bfloat16().float()
    x[0, :64] = 0.0                                   # a group of zeros
    planes, sums, xs = H.qmv_h2_prep(x, PER=8, GROUP=64, backend=backend, config={"BLOCK_KW": 16})
    want = H._prep_spec(x, PER=8, GROUP=64)
    assert torch.equal(planes.view(torch.int32), want[0].view(torch.int32))
    assert torch.equal(xs, want[2])
    assert torch.all((xs.log2() == xs.log2().round()) & (x.reshape(3, 4, 64).abs().amax(-1) < xs))
    assert torch.allclose(sums, x.reshape(3, 4, 64).sum(-1), rtol=1e-5, atol=1e-5)
    # the planes hold a bf16 x itself: fp16 keeps all 8 bits of a value scaled into (-1, 1) down to
    # 2^-14 (its normal range); below that, subnormal fp16 keeps it to 2^-24 of the group's scale
    back, scale = H._x_of(planes, xs), xs.repeat_interleave(64, dim=1)
    normal = x.abs() >= scale * 2 ** -14
    assert normal.float().mean() > 0.5
    assert torch.equal(back[normal], x[normal])
    assert ((back - x).abs() <= scale * 2 ** -25).all()


def test_other_bit_widths_are_refused():
    x, qw, _ = mlx_case(1, 8, 64, 3, 64, seed=1)
    with pytest.raises(ValueError, match="4, 8"):
        H.run_qmv_h2(x, qw.packed, qw.scales, qw.biases, backend="reference")


@pytest.mark.parametrize("chain", [2, 4])
def test_chained_fp16_accumulators_stay_below_bf16s_own_rounding(chain):
    """CHAIN words per fp16 accumulator (gemv.Frame.h2_group_dot): on a llama-sized row (K = 4096, 4-bit
    gs64, N(0,1) activations) the GEMV's RMS error against the exact product stays below the error of
    rounding that exact product to bf16, the dtype the runtime keeps it in; it grows with the chain."""
    g = torch.Generator().manual_seed(11)
    w = QWeight.quantize(torch.randn(64, 4096, generator=g) * 0.02, bits=4, group_size=64)
    x = torch.randn(1, 4096, generator=g).bfloat16().float()
    exact = x.double() @ w.dequantize(torch.float32).double().T

    def rms(y):
        return ((y.double() - exact) ** 2).mean().sqrt().item()

    def gemv(c):
        return H.run_qmv_h2(x, w.packed, w.scales, w.biases, backend="reference",
                            config={"BLOCK_N": 64, "BLOCK_KW": 512, "CHAIN": c})
    assert w.scales.dtype == torch.float32            # the GEMV's own output, not rounded to bf16
    assert rms(gemv(1)) <= rms(gemv(chain)) < rms(exact.bfloat16())
