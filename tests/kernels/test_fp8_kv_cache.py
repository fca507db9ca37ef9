"""An fp8 (e4m3) KV cache: the kernels that write the cache round into it as torch's cast does, and attention over
it equals the float64 formula over the values it holds (the fp8 values, widened), on the Triton interpreter, the
numpy reference and numba. The models' end of it (--kv-cache-dtype fp8) is tested in tests/runtime."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import attention as A
from kilnx.kernels import attention_split as AS

from test_attention import inputs
from test_attention_decode import case, composition, run as run_fused

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")
F8 = torch.float8_e4m3fn
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)}


def fp8_caches(k_cache, v_cache, scale=4.0):
    """The caches as fp8, values spread over e4m3's binades (and a few past 448, which saturate)."""
    k, v = k_cache.float() * scale, v_cache.float() * scale
    k.view(-1)[::97] = 1000.0
    return k.to(F8), v.to(F8)


def check(got, want):
    rtol, atol = TOL[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(B=st.sampled_from([1, 2]), T=st.sampled_from([1, 3]), heads=st.sampled_from([(2, 1), (4, 2), (3, 1)]),
       split=st.sampled_from([0, 16]), qdtype=st.sampled_from(["f32", "bf16"]), seed=st.integers(0, 2**16))
def test_attention_over_an_fp8_cache_is_the_formula_over_its_values(B, T, heads, split, qdtype, seed):
    q, k_cache, v_cache, positions = inputs(B, T, *heads, 16, qdtype, seed, spare=20)
    kc, vc = fp8_caches(k_cache, v_cache)
    scale = 16 ** -0.5 / 4          # the caches' values are 4x the unit-scale inputs
    want = A.attention_formula(q, kc, vc, positions, scale)
    kw = A._kernel_kwargs(q, kc, scale, None, None)
    for backend in ("triton", "reference"):
        if split:
            got = AS.attention_split(q, kc, vc, positions, kw, backend=backend,
                                     config={"BLOCK_M": 16, "BLOCK_N": 16, "KEYS_PER_SPLIT": split})
        else:
            got = A.attention_kernel(q, kc, vc, positions, backend=backend, config={"BLOCK_M": 16, "BLOCK_N": 16},
                                     **kw)
        check(got / 4, want / 4)


def test_attention_over_an_fp8_cache_on_numba():
    q, k_cache, v_cache, positions = inputs(2, 3, 4, 2, 16, "f32", seed=3, spare=20)
    kc, vc = fp8_caches(k_cache, v_cache)
    kw = A._kernel_kwargs(q, kc, 0.25, None, None)
    want = A.attention_formula(q, kc, vc, positions, 0.25)
    check(A.attention_kernel(q, kc, vc, positions, backend="numba", config={"BLOCK_M": 16, "BLOCK_N": 16}, **kw), want)


@pytest.mark.parametrize("backend", ["triton", "reference", "numba"])
@pytest.mark.parametrize("split", [0, 16])
def test_the_fused_decode_step_writes_the_fp8_cache_and_attends_over_it(backend, split):
    """attention_decode's kernels (rope, cache write and attention in one) against rope_and_cache_ then the
    formula: the new key and value land in the fp8 cache rounded from fp32 (within one fp8 step of the
    composition's, which rotates in float64), and attention reads what was written."""
    q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache = case(2, 4, 2, 16, 16, "f32", seed=5)
    args = (q, k_new * 4, v_new * 4, positions, rows, inv_freq, *fp8_caches(k_cache, v_cache))
    want, want_k, want_v = composition(*args, None, False)
    out, kc, vc = run_fused(split, args, None, False, backend)
    assert kc.dtype == F8 and vc.dtype == F8
    torch.testing.assert_close(kc.float(), want_k.float(), rtol=2 ** -3, atol=2 ** -9)
    assert torch.equal(vc.view(torch.uint8), want_v.view(torch.uint8))     # v is stored as given: one rounding
    from kilnx.kernels.rope import rotated
    q_rotated = rotated(q[:, 0], positions[:, 0], inv_freq, False)[:, None]
    torch.testing.assert_close(out.double(), A.attention_formula(q_rotated, kc, vc, positions, 0.25).double(),
                               rtol=2e-5, atol=2e-5)


def test_rope_cache_rounds_into_fp8_as_torch_casts():
    """The prefill path's cache write (rope_cache_kernel): rotated k and v as fp8, v bit for bit torch's cast."""
    from kilnx.kernels import rope
    T, Hq, Hk, D = 5, 4, 2, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, h, D, generator=g) * 30 for h in (Hq, Hk, Hk))
    positions, rows = torch.arange(3, 3 + T), torch.zeros(T, dtype=torch.long)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    kc, vc = (torch.zeros(1, Hk, 16, D, dtype=F8) for _ in range(2))
    want = rope._rope_cache_spec(q, k, v, positions, rows, inv_freq, kc, vc)
    for backend in ("triton", "reference", "numba"):
        q2, kc2, vc2 = q.clone(), kc.clone(), vc.clone()
        rope.rope_cache_kernel(q2, k, v, positions, rows, inv_freq, kc2, vc2, backend=backend)
        torch.testing.assert_close(kc2.float(), want[1].float(), rtol=2 ** -3, atol=0, msg=backend)
        assert torch.equal(vc2.view(torch.uint8), want[2].view(torch.uint8)), backend
        assert torch.equal(vc2[0, :, 3:3 + T].float().transpose(0, 1), v.to(F8).float()), backend
