"""kilnx/kernels/qk_norm_rope.py: per-head RMSNorm of q and k, rotary embedding and KV-cache write in one
launch, against the two-step meaning (rms_norm of each head, rounded to the dtype, then rope_and_cache_).

Over random shapes (T in {1, 3, 9}, grouped k heads, head dims 16/64/128, neox and interleaved layouts,
gemma's 1 + w weights, q/k/v as column slices of one fused qkv output, heads not a multiple of the head
block): the Triton kernel under the interpreter = the numpy reference interpreter = the float64 formula,
and numba on fixed specializations. Cache slots other than the new tokens' stay as they were.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx import ops_torch
from kilnx.kernels import qk_norm_rope as QK

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")


def inputs(T, Hq, Hk, D, offset, seed, S=12):
    g = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(T, (Hq + 2 * Hk) * D, generator=g)).bfloat16()
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hk) * D].view(T, Hk, D)
    v = qkv[:, (Hq + Hk) * D:].view(T, Hk, D)
    norms = [((0.0 if offset else 1.0) + 0.3 * torch.randn(D, generator=g)).bfloat16() for _ in range(2)]
    positions = torch.randperm(S, generator=g)[:T]
    rows = torch.randint(0, 2, (T,), generator=g)
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    caches = [torch.randn(2, Hk, S, D, generator=g).bfloat16() for _ in range(2)]
    return qkv, q, k, v, norms, positions, rows, inv_freq, caches


def expected(q, k, v, norms, positions, rows, inv_freq, caches, eps, offset, interleaved):
    """rms_norm per head (rounded to bf16), then rope_and_cache_, both from the torch ops."""
    qn = ops_torch.rms_norm(q, norms[0], eps, weight_offset=offset)
    kn = ops_torch.rms_norm(k, norms[1], eps, weight_offset=offset)
    kc, vc = caches[0].clone(), caches[1].clone()
    ops_torch.rope_and_cache_(qn, kn, v.clone(), positions, rows, inv_freq, kc, vc, interleaved=interleaved)
    return qn, kc, vc


def run(backend, T, Hq, Hk, D, offset, interleaved, block_h, seed):
    eps = 1e-6
    qkv, q, k, v, norms, positions, rows, inv_freq, caches = inputs(T, Hq, Hk, D, offset, seed)
    want_q, want_kc, want_vc = expected(q.clone(), k.clone(), v, norms, positions, rows, inv_freq, caches, eps,
                                        offset, interleaved)
    v_before = v.clone()
    kc, vc = caches[0].clone(), caches[1].clone()
    QK.qk_norm_rope_cache_kernel(q, k, v, *norms, positions, rows, inv_freq, kc, vc, eps=eps, offset=offset,
                                 INTERLEAVED=interleaved, backend=backend, config={"BLOCK_H": block_h})
    # one bf16 ulp (|values| < 8 after the norm): the formula's rounding is in float64 and fp32 sums differ
    # in order; the interpreter truncates its fp32 -> bf16 casts
    torch.testing.assert_close(q.double(), want_q.double(), rtol=1e-2, atol=0.07)
    torch.testing.assert_close(kc.double(), want_kc.double(), rtol=1e-2, atol=0.07)
    assert torch.equal(vc, want_vc) and torch.equal(v, v_before), "v must be copied bit for bit"
    untouched = torch.ones_like(kc, dtype=torch.bool)
    untouched[rows, :, positions] = False
    assert torch.equal(kc[untouched], caches[0][untouched]), "a cache slot outside the new tokens changed"


@settings(max_examples=10, deadline=None, derandomize=True)
@given(T=st.sampled_from([1, 3, 9]), heads=st.sampled_from([(2, 1), (4, 2), (6, 2), (3, 3)]),
       D=st.sampled_from([16, 64, 128]), offset=st.sampled_from([0.0, 1.0]), interleaved=st.booleans(),
       block_h=st.sampled_from([1, 2, 4]), backend=st.sampled_from(["triton", "reference"]))
def test_equals_rms_norm_then_rope_and_cache(T, heads, D, offset, interleaved, block_h, backend):
    run(backend, T, *heads, D, offset, interleaved, block_h, seed=T * 100 + D)


@pytest.mark.parametrize("interleaved", [False, True])
def test_numba_equals_rms_norm_then_rope_and_cache(interleaved):
    run("numba", 3, 4, 2, 64, 0.0, interleaved, 2, seed=7)


def test_partial_rotary_is_refused_with_the_way_out():
    q = torch.zeros(1, 2, 64).bfloat16()
    with pytest.raises(ValueError, match="full rotary width.*rope_and_cache_"):
        QK.qk_norm_rope_cache_(q, q[:, :1], q[:, :1], torch.ones(64), torch.ones(64), 1e-6,
                               torch.zeros(1).long(), torch.zeros(1).long(), torch.ones(16),
                               torch.zeros(1, 1, 4, 64), torch.zeros(1, 1, 4, 64))
