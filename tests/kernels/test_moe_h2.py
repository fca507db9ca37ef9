"""kilnx/kernels/moe_h2.py: the decode MoE on packed-fp16 GEMVs = MLX's gather_qmm with the epilogues.

MLX (`mlx[cpu]`) gives each slot's product (mx.gather_qmm on the same expert stack); the GLU and the
routing-weighted sum over top_k are numpy on MLX's products. The kernels take the activations in
qmv_h2's prepared form, which is exact (x = fp16 planes times a power of two per group), and round
products and 4-term sums to fp16: held to qmv_h2's bound, 2^-10 * sqrt(K) * max|w| * max|x| per
product. Triton interpreter over shapes and configs (non-power-of-two top_k, several row blocks,
K tails, pipelined and plain loops); numba and the reference interpreter on one case each.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import moe_h2 as MH
from kilnx.kernels import qmv_h2 as H
from kilnx.kernels.moe_specs import TORCH_ACTIVATIONS

mx = pytest.importorskip("mlx.core")
from test_moe import experts, mlx_gather, routing  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")


def bound(x, qw, k):
    wmax = qw.dequantize(torch.float32).abs().max().item()
    return 2 ** -10 * k ** 0.5 * wmax * x.float().abs().max().item()


def check(got, want, tol):
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.isfinite(got.float()).all()
    # the kernels round their output to bf16 as well
    err = (got.double() - want).abs().max().item()
    assert err <= tol + 2 ** -8 * want.abs().max().item() + 1e-5, f"max error {err}"


def glu_case(T, k, E, F, K, bits, seed, act="silu"):
    x = torch.randn(T, K).bfloat16()
    ids, weights = routing(T, k, E, seed)
    mw, qw = experts(E, 2 * F, K, bits, 64, seed)
    y = mlx_gather(x, mw, ids, bits, 64)
    gate, up = y[:, :F], y[:, F:]
    want = TORCH_ACTIVATIONS[act](gate) * up
    # |act(g) * u| <= (|g| + 1) |u|: the bound on each product, scaled by the other
    tol = bound(x, qw, K) * (2 * y.abs().max().item() + 1)
    return x, ids, weights, qw, want, tol


@settings(max_examples=6, deadline=None, derandomize=True)
@given(T=st.sampled_from([1, 2, 4]), k=st.sampled_from([1, 3, 4]), bits=st.sampled_from([4, 8]),
       F=st.sampled_from([32, 64]), groups=st.sampled_from([1, 3]), act=st.sampled_from(["silu", "gelu_tanh"]),
       cfg=st.sampled_from([{"BLOCK_N": 8, "BLOCK_KW": 8, "STAGES": 1}, {"BLOCK_N": 16, "BLOCK_KW": 16, "STAGES": 2},
                            {"BLOCK_N": 4, "BLOCK_KW": 64, "STAGES": 1, "CHAIN": 2},
                            {"BLOCK_N": 8, "BLOCK_KW": 16, "STAGES": 1, "CHAIN": 4}]))
def test_gate_up_glu_matches_mlx(T, k, bits, F, groups, act, cfg):
    x, ids, _, qw, want, tol = glu_case(T, k, 6, F, 64 * groups, bits, seed=T * 10 + k, act=act)
    planes, sums, xs = H.qmv_h2_prep(x, PER=32 // bits, GROUP=64, backend="reference")
    got = MH.gather_qmv_h2_glu(planes, sums, xs, qw.packed, qw.scales, qw.biases, ids, ACT=act, backend="triton",
                               config=cfg)
    check(got, want, tol)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(T=st.sampled_from([1, 2, 4]), k=st.sampled_from([1, 3, 6]), bits=st.sampled_from([4, 8]),
       F=st.sampled_from([32, 96]), groups=st.sampled_from([1, 3]),
       cfg=st.sampled_from([{"BLOCK_N": 8, "BLOCK_KW": 8, "STAGES": 1}, {"BLOCK_N": 32, "BLOCK_KW": 16, "STAGES": 2},
                            {"BLOCK_N": 4, "BLOCK_KW": 64, "STAGES": 1, "CHAIN": 2}]))
def test_ungated_up_and_relu2_match_mlx(T, k, bits, F, groups, cfg):
    """Experts without a gate (nemotron-3's): relu²(x W_up^T) per (token, slot), up rows alone in the tile."""
    K = 64 * groups
    x = torch.randn(T, K).bfloat16()
    ids, _ = routing(T, k, 7, seed=T + k)
    mw, qw = experts(7, F, K, bits, 64, seed=F + k)
    y = mlx_gather(x, mw, ids, bits, 64)
    want = torch.relu(y).square()
    planes, sums, xs = H.qmv_h2_prep(x, PER=32 // bits, GROUP=64, backend="reference")
    got = MH.gather_qmv_h2_act(planes, sums, xs, qw.packed, qw.scales, qw.biases, ids, ACT="relu2", backend="triton",
                               config=cfg)
    check(got, want, bound(x, qw, K) * (2 * y.abs().max().item() + 1))     # (u + e)² - u² ~ 2 |u| e


def test_the_ungated_decode_is_the_composition_of_its_kernels():
    """ungated_decode: prep, up + relu², prep, down + combine; the float64 formula over MLX's products."""
    T, k, E, H_, F = 2, 3, 5, 64, 64
    x = torch.randn(T, H_).bfloat16()
    ids, weights = routing(T, k, E, seed=5)
    mu, up = experts(E, F, H_, 4, 64, seed=6)
    md, dn = experts(E, H_, F, 4, 64, seed=7)
    h = torch.relu(mlx_gather(x, mu, ids, 4, 64)).square()
    want = (mlx_gather(h.bfloat16(), md, ids, 4, 64).reshape(T, k, H_) * weights.double()[..., None]).sum(1)
    got = MH.ungated_decode(x, up, dn, ids, weights.bfloat16(), backend="triton")
    assert got.dtype == torch.bfloat16
    check(got, want, 4e-2 * want.abs().max().item())


@settings(max_examples=6, deadline=None, derandomize=True)
@given(T=st.sampled_from([1, 3]), k=st.sampled_from([1, 3, 4]), bits=st.sampled_from([4, 8]),
       N=st.sampled_from([24, 64]), groups=st.sampled_from([1, 2]),
       cfg=st.sampled_from([{"BLOCK_N": 8, "BLOCK_KW": 8, "STAGES": 1}, {"BLOCK_N": 16, "BLOCK_KW": 16, "STAGES": 3},
                            {"BLOCK_N": 4, "BLOCK_KW": 32, "STAGES": 1, "CHAIN": 2}]))
def test_down_combine_matches_mlx(T, k, bits, N, groups, cfg):
    """Slots past top_k (the program's tile rounds top_k up to a power of two) weigh nothing."""
    K = 64 * groups
    if cfg["BLOCK_N"] < (1 << (k - 1).bit_length()):
        cfg = {**cfg, "BLOCK_N": 1 << (k - 1).bit_length()}
    h = torch.randn(T * k, K).bfloat16()
    ids, weights = routing(T, k, 5, seed=T + 7 * k)
    mw, qw = experts(5, N, K, bits, 64, seed=N + k)
    y = mlx_gather(h, mw, ids, bits, 64).reshape(T, k, N)
    want = (y * weights.double()[..., None]).sum(1)
    planes, sums, xs = H.qmv_h2_prep(h, PER=32 // bits, GROUP=64, backend="reference")
    got = MH.gather_qmv_h2_combine(planes, sums, xs, qw.packed, qw.scales, qw.biases, ids, weights.bfloat16(),
                                   backend="triton", config=cfg)
    # weights in bf16 (the kernel's input) against the float64 ones: 2^-8 of each term
    check(got, want, bound(h, qw, K) * k + 2 ** -8 * y.abs().max().item())


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_other_backends_on_one_case(backend):
    x, ids, weights, qw, want, tol = glu_case(2, 3, 5, 64, 128, 4, seed=3)
    planes, sums, xs = H.qmv_h2_prep(x, PER=8, GROUP=64, backend="reference")
    cfg = {"BLOCK_N": 8, "BLOCK_KW": 8, "STAGES": 1}
    got = MH.gather_qmv_h2_glu(planes, sums, xs, qw.packed, qw.scales, qw.biases, ids, backend=backend, config=cfg)
    check(got, want, tol)
    _, dn = experts(5, 24, 64, 8, 64, seed=4)
    hp = H.qmv_h2_prep(got, PER=4, GROUP=64, backend="reference")
    y = MH.gather_qmv_h2_combine(*hp, dn.packed, dn.scales, dn.biases, ids, weights.bfloat16(), backend=backend,
                                 config=cfg)
    ref = MH.gather_qmv_h2_combine(*hp, dn.packed, dn.scales, dn.biases, ids, weights.bfloat16(),
                                   backend="triton", config=cfg)
    assert torch.allclose(y.float(), ref.float(), rtol=2 ** -7, atol=1e-3)


def test_row_blocks_that_split_a_glu_half_or_the_slots_are_refused():
    x, ids, weights, qw, _, _ = glu_case(1, 3, 4, 24, 64, 4, seed=1)    # 2F = 48: 16 rows do not tile it
    planes, sums, xs = H.qmv_h2_prep(x, PER=8, GROUP=64, backend="reference")
    with pytest.raises(Exception, match="BLOCK_N 32 must divide 2F"):
        MH.gather_qmv_h2_glu(planes, sums, xs, qw.packed, qw.scales, qw.biases, ids, backend="triton",
                             config={"BLOCK_N": 32, "BLOCK_KW": 8})
    with pytest.raises(Exception, match="multiple of the 4 slots"):
        MH.gather_qmv_h2_combine(planes, sums, xs, qw.packed, qw.scales, qw.biases, ids, weights, backend="triton",
                                 config={"BLOCK_N": 2, "BLOCK_KW": 8})


def test_tuning_inputs_pass_the_kernels_own_gate():
    """What the tuner builds for the qwen3-30b-a3b problems, scaled down: spec and tolerance accept the
    kernel's output (a tune's correctness gate)."""
    for kernel in (MH.gather_qmv_h2_glu, MH.gather_qmv_h2_combine, MH.gather_qmv_h2_act):
        problem = {**kernel.sample_problems()[0], "E": 6, "top_k": 3}
        problem.update({"N": 32, "K": 64} if kernel is MH.gather_qmv_h2_combine else {"N": 64, "K": 128})
        args = MH.make_args(problem, "cpu")
        got = kernel(*args, backend="triton", config={"BLOCK_N": 4, "BLOCK_KW": 8, "STAGES": 1})
        want = kernel.reference(*args)
        rtol, atol = kernel.tolerance(args)
        assert np.isfinite(atol) and torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol)


def test_prepared_activations_skip_the_prep_and_give_the_same_result():
    """kilnx.ops.moe takes x already in qmv_h2's form (what an MoE layer's add+RMSNorm emits with
    the GPU's decode path): the decode kernels read it as it is, bit for bit what preparing x gives."""
    import kilnx.ops as ops
    from kilnx.kernels.prepared import PreparedX
    x, ids, weights, gu, _, _ = glu_case(2, 3, 4, 64, 128, 4, seed=7)
    _, dn = experts(4, 128, 64, 4, 64, seed=8)
    planes, sums, xs = H.qmv_h2_prep(x, PER=8, GROUP=64)
    prepared = PreparedX(planes, sums, xs, x.dtype)
    plain = MH.moe_decode(x, gu, dn, ids, weights.bfloat16())
    assert torch.equal(ops.moe(prepared, gu, dn, ids, weights.bfloat16()), plain)
    with pytest.raises(ValueError, match="pass plain activations"):     # prepared for 8-bit weights
        ops.moe(PreparedX(*H.qmv_h2_prep(x, PER=4, GROUP=64), x.dtype), gu, dn, ids, weights.bfloat16())


def test_moe_layers_ask_for_prepared_x_only_for_the_gpu_decode_path(monkeypatch):
    from types import SimpleNamespace
    gpu_stack = SimpleNamespace(packed=SimpleNamespace(is_cuda=True), mode="affine", bits=4)
    x1, x8 = torch.zeros(1, 64), torch.zeros(8, 64)
    monkeypatch.setenv("KILNX_MOE_PREPARED", "0")
    assert not MH.takes_prepared(x1, gpu_stack)                 # switched off (for comparisons)
    monkeypatch.delenv("KILNX_MOE_PREPARED", raising=False)
    assert MH.takes_prepared(x1, gpu_stack)                     # on by default
    assert not MH.takes_prepared(x8, gpu_stack)                 # prefill: the grouped GEMMs take plain x
    assert not MH.takes_prepared(x1, SimpleNamespace(**{**vars(gpu_stack), "bits": 2}))
    assert not MH.takes_prepared(x1, SimpleNamespace(**{**vars(gpu_stack), "packed": SimpleNamespace(is_cuda=False)}))
