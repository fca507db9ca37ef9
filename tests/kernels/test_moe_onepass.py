"""kilnx/kernels/moe_onepass.py: the decode MoE in one launch = MLX's gather_qmm, activation, gather_qmm
again and the routing-weighted sum.

MLX (`mlx[cpu]`) gives each slot's gate_up product; the GLU and the routing weights are applied in float64
here, then mx.gather_qmm multiplies the slots' h by their experts' down weights and the slots are summed.
The kernel rounds x to fp16 planes (exact: prepared input), and h to fp16 pairs scaled by a power of two
per program block, with fp16 products and 4-term sums: held to 2^-7 of the largest output.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import moe_onepass as MO
from kilnx.kernels import qmv_h2 as H
from kilnx.kernels.moe_specs import TORCH_ACTIVATIONS

mx = pytest.importorskip("mlx.core")
from test_moe import experts, mlx_gather, routing  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")


def case(T, k, E, F, K, HD, bits, bits_d, seed, act="silu", gs_d=64):
    """Prepared x, routing, the two stacks, MLX's result and the error bound."""
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(seed)).bfloat16()
    ids, weights = routing(T, k, E, seed)
    weights = weights.bfloat16()                          # the kernel's input dtype
    mgu, gu = experts(E, 2 * F, K, bits, 64, seed)
    mdn, dn = experts(E, HD, F, bits_d, gs_d, seed + 1)
    y = mlx_gather(x, mgu, ids, bits, 64)
    h = TORCH_ACTIVATIONS[act](y[:, :F]) * y[:, F:] * weights.double().reshape(-1, 1)
    want = mlx_gather(h, mdn, ids, bits_d, gs_d).reshape(T, k, HD).sum(1)
    # fp16 products (2^-11 each) summed with random signs through two GEMVs and the GLU: the worst-case
    # chain of qmv_h2's per-GEMV bounds is ~300x the errors seen (~2^-9 of the largest output), too loose to
    # catch a wrong term; 2^-7 of the largest output is 4x those errors and fails a bias term off by 1%
    tol = 2 ** -7 * want.abs().max().item()
    planes, sums, xs = H.qmv_h2_prep(x, PER=32 // bits, GROUP=64, backend="reference")
    return (planes, sums, xs), gu, dn, ids, weights, want, tol


def check(got, want, tol):
    assert got.dtype == torch.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    err = (got.double() - want).abs().max().item()
    assert err <= tol + 1e-5, f"max error {err} > {tol}"


@settings(max_examples=6, deadline=None, derandomize=True)
@given(T=st.sampled_from([1, 2]), k=st.sampled_from([1, 3, 4]), bits=st.sampled_from([4, 8]),
       bits_d=st.sampled_from([4, 8]), F=st.sampled_from([64, 128]), HD=st.sampled_from([24, 64]),
       gs_d=st.sampled_from([32, 64]),
       act=st.sampled_from(["silu", "gelu_tanh"]), down_t=st.booleans(),
       cfg=st.sampled_from([{"BLOCK_F": 8, "BLOCK_KW": 8, "BLOCK_H": 16, "STAGES": 1},
                            {"BLOCK_F": 16, "BLOCK_KW": 16, "BLOCK_H": 32, "STAGES": 2},
                            {"BLOCK_F": 32, "BLOCK_KW": 64, "BLOCK_H": 64, "STAGES": 1, "CHAIN": 2}]))
def test_one_pass_matches_mlx(T, k, bits, bits_d, F, HD, gs_d, act, down_t, cfg):
    """Output rows past a BLOCK_H tail (24 of 32), blocks of 8 to 32 features, down groups of 32 and 64, down
    in MLX's layout or transposed."""
    prep, gu, dn, ids, weights, want, tol = case(T, k, 5, F, 128, HD, bits, bits_d, seed=T * 10 + k, act=act,
                                                 gs_d=gs_d)
    got = MO.moe_onepass(*prep, gu, MO.down_transposed(dn) if down_t else dn, ids, weights, act, config=cfg)
    check(got, want, tol)


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("down_t", [False, True])
def test_other_backends_on_one_case(backend, down_t):
    prep, gu, dn, ids, weights, want, tol = case(2, 3, 4, 64, 64, 24, 4, 8, seed=5)
    cfg = {"BLOCK_F": 16, "BLOCK_KW": 8, "BLOCK_H": 16, "STAGES": 1}
    dn = MO.down_transposed(dn) if down_t else dn
    args = (*prep, gu.packed, gu.scales, gu.biases, dn.packed, dn.scales, dn.biases, ids, weights)
    check(MO.moe_onepass_h2(*args, backend=backend, config=cfg), want, tol)


def test_the_layouts_are_told_apart_by_shape():
    _, _, dn, _, _, _, _ = case(1, 2, 3, 64, 64, 64, 4, 4, seed=1)     # H = F: only the scales tell
    t = MO.down_transposed(dn)
    assert not MO._down_transposed(dn.packed, dn.scales) and MO._down_transposed(t.packed, t.scales)


def test_blocks_that_straddle_a_down_group_are_refused():
    prep, gu, dn, ids, weights, _, _ = case(1, 2, 3, 128, 64, 16, 4, 4, seed=2)    # down's groups: 64 features
    with pytest.raises(Exception, match="BLOCK_F 128 must divide"):
        MO.moe_onepass(*prep, gu, dn, ids, weights, config={"BLOCK_F": 128, "BLOCK_KW": 8, "BLOCK_H": 16})


def test_the_decode_route_serves_either_path_and_defaults_to_the_two_kernels(monkeypatch):
    """kernels/moe_decode_route.py: both paths give the one pass's meaning within the tuner's tolerance (what
    `kilnx tune` checks before timing them); untuned, the two kernels; KILNX_MOE_PATH overrides."""
    from kilnx.kernels.moe_decode_route import moe_decode_path as route
    problem = {**route.sample_problems()[0], "E": 4, "top_k": 2, "N": 128, "K": 64, "T": 2}
    torch.manual_seed(0)
    args = route.make_args(problem, "cpu")
    want = route.reference(*args)
    rtol, atol = route.tolerance(args)
    for path in ("two_kernels", "onepass"):
        got = route.compile({"PATH": path}, *args)(*args)
        assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want, rtol=rtol, atol=atol), path
    assert route.path_for(args) == "two_kernels"
    monkeypatch.setenv("KILNX_MOE_PATH", "onepass")
    assert route.path_for(args) == "onepass"
    monkeypatch.setenv("KILNX_MOE_PATH", "fused")
    with pytest.raises(ValueError, match="KILNX_MOE_PATH must be one of"):
        route.path_for(args)


@pytest.mark.parametrize("down", ["n", "t"])
def test_tuning_inputs_pass_the_kernels_own_gate(down):
    """What the tuner builds for the one pass (scaled down): the spec and tolerance accept its output."""
    problem = {**MO.moe_onepass_h2.sample_problems()[0], "E": 4, "top_k": 2, "N": 128, "K": 64, "down": down}
    args = MO.make_args(problem, "cpu")
    assert MO.moe_onepass_h2.key(*args).endswith(f"down={down}")
    got = MO.moe_onepass_h2(*args, config={"BLOCK_F": 16, "BLOCK_KW": 8, "BLOCK_H": 64, "STAGES": 1})
    rtol, atol = MO.moe_onepass_h2.tolerance(args)
    assert torch.allclose(got, MO.moe_onepass_h2.reference(*args), rtol=rtol, atol=atol)
