"""kilnx/kernels/attention_decode.py: decode attention from the projection's q, k, v, with the rotary
embedding and the cache write fused in, equals rope_and_cache_ followed by attention.

Both variants (one program per (row, KV head), and the split over key ranges merged after) on the
Triton interpreter and the numpy reference, numba on fixed cases: hypothesis over batch rows at
different positions, grouped heads (1-4 per KV head, odd groups), partial rotary (8 of 16 dims), both
rotary pair layouts, sliding windows, fp32 and bf16. The caches the kernels write are compared too."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx import ops_torch
from kilnx.kernels import attention as A
from kilnx.kernels import attention_decode as AD
from kilnx.kernels import attention_split as AS
from kilnx.kernels import rope

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
TOL = {"f32": (2e-5, 2e-5), "bf16": (2e-2, 2e-2)}


def case(B, Hq, Hk, D, rotary, dtype, seed, spare=20):
    """q (B, 1, Hq, D), the new k, v (B, Hk, D), caches (B, Hk, S, D), positions (B, 1), rows, inv_freq."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 40, (B, 1), generator=g)
    S = int(positions.max()) + 1 + spare
    dt = DTYPES[dtype]
    q = torch.randn(B, 1, Hq, D, generator=g).to(dt)
    k_new, v_new = (torch.randn(B, Hk, D, generator=g).to(dt) for _ in range(2))
    k_cache, v_cache = (torch.randn(B, Hk, S, D, generator=g).to(dt) for _ in range(2))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2).float() / rotary))
    return q, k_new, v_new, positions, torch.arange(B), inv_freq, k_cache, v_cache


def composition(q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache, window, interleaved, limit=None):
    """rope_and_cache_ then the attention formula (float64): the output and the caches written."""
    q2, k2, kc, vc = q[:, 0].clone(), k_new.clone(), k_cache.clone(), v_cache.clone()
    rope.rope_and_cache_(q2, k2, v_new, positions[:, 0], rows, inv_freq, kc, vc, interleaved=interleaved)
    return (A.attention_formula(q2[:, None], kc, vc, positions, q.shape[-1] ** -0.5, None, window, limit=limit), kc,
            vc)


def run(split, args, window, interleaved, backend, limit=None):
    q, *_, k_cache, v_cache = args
    kc, vc = k_cache.clone(), v_cache.clone()
    a = (*args[:-2], kc, vc)
    kw = A._kernel_kwargs(q, k_cache, q.shape[-1] ** -0.5, None, window, limit)
    if split:
        parts = AD.attention_split_new_kv_kernel(*a, backend=backend, INTERLEAVED=interleaved, **kw,
                                                 config={"BLOCK_M": 16, "BLOCK_N": 16, "KEYS_PER_SPLIT": split})
        out = AS.merge(parts, q, None, backend)
    else:
        out = AD.attention_new_kv_kernel(*a, backend=backend, INTERLEAVED=interleaved, **kw,
                                         config={"BLOCK_M": 16, "BLOCK_N": 16})
    return out, kc, vc


def check(got, want, dtype):
    rtol, atol = TOL[dtype]
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g.double(), w.double(), rtol=rtol, atol=atol)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(B=st.sampled_from([1, 2]), heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 1)]),
       rotary=st.sampled_from([16, 8]), interleaved=st.booleans(), window=st.sampled_from([None, 4]),
       split=st.sampled_from([0, 16, 32]), dtype=st.sampled_from(["f32", "bf16"]), seed=st.integers(0, 2**16))
def test_fused_decode_attention_equals_rope_cache_then_attention(B, heads, rotary, interleaved, window, split, dtype,
                                                                 seed):
    args = case(B, *heads, 16, rotary, dtype, seed)
    want = composition(*args, window, interleaved)
    for backend in ("triton", "reference"):
        check(run(split, args, window, interleaved, backend), want, dtype)


@pytest.mark.parametrize("split", [0, 16])
def test_fused_decode_attention_on_numba(split):
    args = case(2, 4, 2, 16, 16, "f32", seed=11)
    check(run(split, args, None, False, "numba"), composition(*args, None, False), "f32")


@pytest.mark.parametrize("split", [0, 16])
@pytest.mark.parametrize("backend", ["triton", "reference", "numba"])
def test_a_parked_row_writes_its_junk_at_the_parking_slot_and_attends_to_nothing(split, backend):
    """A batched decode step with row 1 parked (position = limit = the cache's last slot): the row's new k, v land
    in that slot as any row's do, its output is 0, and row 0 attends as without parking."""
    args = list(case(2, 4, 2, 16, 16, "f32", seed=13))
    limit = args[6].shape[2] - 1
    args[3] = torch.tensor([[int(args[3][0, 0])], [limit]])
    want = composition(*args, None, False, limit=limit)
    assert torch.equal(want[0][1], torch.zeros_like(want[0][1]))
    got = run(split, args, None, False, backend, limit=limit)
    check(got, want, "f32")
    assert torch.equal(got[0][1], torch.zeros_like(got[0][1]))


def test_a_split_decode_walks_the_context_not_the_parking_slot(monkeypatch):
    """Where the GPU splits a decode step's keys, ops.attention and the fused ops.attention_new_tokens hand the split
    kernels the caches cut at the parking limit: ranges over the context only (S = limit), the live row's output and
    cache writes those of the uncut composition, the parked row's output 0 and its junk written nowhere."""
    import kilnx.ops as kops
    monkeypatch.setattr(AS, "use_split", lambda q, k_cache: True)   # the GPU's rule, on the interpreter
    monkeypatch.setenv("KILNX_FUSED_ROPE", "1")
    seen = []
    for module, name in ((AD, "attention_split_new_kv_kernel"), (AS, "attention_split_kernel")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, **k: seen.append(a[-2].shape[2] if len(a) == 8
                                                                              else a[1].shape[2]) or real(*a, **k))
    args = list(case(2, 4, 2, 16, 16, "f32", seed=17))
    q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache = args
    limit = k_cache.shape[2] - 1
    positions = torch.tensor([[int(positions[0, 0])], [limit]])
    want, kc_want, vc_want = composition(q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache, None, False,
                                         limit=limit)
    kc, vc = k_cache.clone(), v_cache.clone()
    got = kops.attention_new_tokens(q[:, 0].clone(), k_new.clone(), v_new.clone(), positions, rows, inv_freq, kc, vc,
                                    16 ** -0.5, limit=limit)
    assert seen == [limit]
    check((got, kc[0], vc[0]), (want, kc_want[0], vc_want[0]), "f32")
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.equal(kc[1], k_cache[1]) and torch.equal(vc[1], v_cache[1])     # the parked row wrote nothing
    plain = kops.attention(q, kc, vc, positions, 16 ** -0.5, limit=limit)
    assert seen == [limit, limit]
    check((plain,), (A.attention_formula(q, kc, vc, positions, 16 ** -0.5, limit=limit),), "f32")


@pytest.mark.parametrize("fused", ["0", "1"])
def test_ops_attention_new_tokens_is_rope_and_cache_then_attention(fused, monkeypatch):
    """kilnx.ops.attention_new_tokens, fused or not (KILNX_FUSED_ROPE), = the torch peer's two ops; with
    several tokens per row (a prefill chunk) it always takes the two ops."""
    import kilnx.ops as kops
    monkeypatch.setenv("KILNX_FUSED_ROPE", fused)
    g = torch.Generator().manual_seed(3)
    for B, T in ((2, 1), (2, 3)):
        positions = torch.tensor([[5], [9]]) + torch.arange(T)[None, :]
        q = torch.randn(B * T, 4, 16, generator=g)
        k, v = torch.randn(B * T, 2, 16, generator=g), torch.randn(B * T, 2, 16, generator=g)
        k_cache, v_cache = torch.randn(B, 2, 16, 16, generator=g), torch.randn(B, 2, 16, 16, generator=g)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
        rows = torch.arange(B).repeat_interleave(T)
        kc, vc = k_cache.clone(), v_cache.clone()
        got = kops.attention_new_tokens(q.clone(), k.clone(), v, positions, rows, inv_freq, kc, vc, 0.25)
        q2, k2, kc2, vc2 = q.clone(), k.clone(), k_cache.clone(), v_cache.clone()
        ops_torch.rope_and_cache_(q2, k2, v, positions.reshape(-1), rows, inv_freq, kc2, vc2)
        want = ops_torch.attention(q2.view(B, T, 4, 16), kc2, vc2, positions, 0.25)
        check((got, kc, vc), (want, kc2, vc2), "f32")


def test_fused_path_is_on_by_default_only_where_measured(monkeypatch):
    monkeypatch.delenv("KILNX_FUSED_ROPE", raising=False)
    assert AD.enabled("cpu", split=True) and AD.enabled("cpu", split=False)
    assert AD.enabled("cuda", split=False) and not AD.enabled("cuda", split=True)
    monkeypatch.setenv("KILNX_FUSED_ROPE", "0")
    assert not AD.enabled("cpu", split=False) and not AD.enabled("cuda", split=False)
    monkeypatch.setenv("KILNX_FUSED_ROPE", "1")
    assert AD.enabled("cuda", split=True)
