"""kernels/moe_glu_prep.gather_qmv_h2_glu_prep: the decode MoE's gate_up + activation with h prepared for down in
one launch equals the two launches it replaces (gather_qmv_h2_glu, then qmv_h2_prep) bit for bit on the interpreter,
over tokens, top_k, bits, activations and down formats; the whole decode MoE through it (KILNX_MOE_GLU_PREP=1) gives
the two launches' result; tiles that split a group of h are refused."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import moe_glu_prep as G
from kilnx.kernels import moe_h2 as MH
from kilnx.kernels import qmv_h2 as H

pytest.importorskip("mlx.core")
from test_moe import experts, routing  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")


def case(T, k, E, F, K, bits, seed):
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(seed)).bfloat16()
    ids, weights = routing(T, k, E, seed)
    _, qw = experts(E, 2 * F, K, bits, 64, seed)
    return H.qmv_h2_prep(x, PER=32 // bits, GROUP=64, backend="reference"), qw, ids, weights


@settings(max_examples=5, deadline=None, derandomize=True)
@given(T=st.sampled_from([1, 2]), k=st.sampled_from([1, 3]), bits=st.sampled_from([4, 8]),
       act=st.sampled_from(["silu", "gelu_tanh"]), out=st.sampled_from([(8, 64), (4, 32), (8, 32)]),
       stages=st.sampled_from([1, 2]))
def test_one_launch_equals_the_glu_then_the_prep(T, k, bits, act, out, stages):
    per, group = out
    xp, qw, ids, _ = case(T, k, 4, 64, 128, bits, seed=T + 3 * k + bits)
    cfg = {"BLOCK_N": 2 * group, "BLOCK_KW": 16, "STAGES": stages}
    got = G.gather_qmv_h2_glu_prep(*xp, qw.packed, qw.scales, qw.biases, ids, PER_OUT=per, GROUP_OUT=group, ACT=act,
                                   backend="triton", config=cfg)
    h = MH.gather_qmv_h2_glu(*xp, qw.packed, qw.scales, qw.biases, ids, ACT=act, backend="triton", config=cfg)
    want = H.qmv_h2_prep(h, PER=per, GROUP=group, backend="triton")
    assert torch.equal(got[0], h)
    for g, w in zip(got[1:], want):
        assert torch.equal(g, w)


def test_the_decode_moe_through_it_gives_the_two_launches_result(monkeypatch):
    xp, gu, ids, weights = case(2, 3, 4, 64, 128, 4, seed=5)
    _, dn = experts(4, 128, 64, 8, 64, seed=6)
    args = (*xp, gu.packed, gu.scales, gu.biases, dn.packed, dn.scales, dn.biases, ids, weights.bfloat16())
    two = MH.two_kernels(*args, backend="triton")
    monkeypatch.setenv("KILNX_MOE_GLU_PREP", "1")
    assert G.serves(gu.packed, dn.scales, (None, None)) and not G.serves(gu.packed, dn.scales, ({}, None))
    # the kernels' default tiles differ (the fused one chains 2 words an fp16 sum): h to fp16 rounding
    got = MH.two_kernels(*args, backend="triton")
    assert (got.float() - two.float()).abs().max().item() <= 2 ** -7 * two.float().abs().max().item()


def test_a_tile_that_splits_a_group_of_h_is_refused():
    xp, qw, ids, _ = case(1, 2, 4, 64, 64, 4, seed=1)
    with pytest.raises(Exception, match="whole groups of 64"):
        G.gather_qmv_h2_glu_prep(*xp, qw.packed, qw.scales, qw.biases, ids, PER_OUT=8, GROUP_OUT=64, backend="triton",
                                 config={"BLOCK_N": 64, "BLOCK_KW": 8})
