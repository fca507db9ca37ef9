"""kilnx/kernels/rope.py: in-place rotary embedding against a float64 torch formula.

Over random shapes (T in {1, 3, 17}, grouped k heads, head dims 16/64, full and partial rotary, neox
and interleaved layouts, fp32/bf16, q/k as contiguous tensors or as column slices of one fused qkv
output): the Triton kernel under the interpreter = the numpy reference interpreter = the formula,
and numba on a few fixed specializations (each costs a numba compile on a cold cache). The dims past
the rotary width and the v slice of a fused qkv output must come through bit-identical.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx import ops_torch
from kilnx.kernels import rope

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
# bf16: the kernel rounds once from fp32, the formula once from fp64 (one ulp apart at most), and the
# Triton interpreter truncates instead of rounding (another ulp): |x| < 5 here, so 2 ulps < 0.07
TOL = {"f32": (2e-5, 2e-5), "bf16": (0.07, 1e-2)}


def inputs(T, Hq, Hk, D, R, dtype, fused, seed, max_pos=100_000):
    """q, k (and the whole fused buffer, or None) plus positions and llama-style inv_freq."""
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    if fused:
        # one projection output [q | k | v] per token: q and k are strided views into it
        qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(dt)
        q = qkv[:, :Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D:(Hq + Hk) * D].view(T, Hk, D)
    else:
        qkv = None
        q = torch.randn(T, Hq, D, generator=g).to(dt)
        k = torch.randn(T, Hk, D, generator=g).to(dt)
    positions = torch.randint(0, max_pos, (T,), generator=g)
    inv_freq = 10000.0 ** (-torch.arange(0, R, 2, dtype=torch.float32) / R)
    return q, k, qkv, positions, inv_freq


def check_rotated(got, want, dtype, R):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got[..., :R].double(), want[..., :R].double(), rtol=rtol, atol=atol)
    assert torch.equal(got[..., R:], want[..., R:]), "dims past the rotary width were modified"


shapes = st.tuples(st.sampled_from([1, 3, 17]),                        # T
                   st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 1)]),  # (Hq, Hk)
                   st.sampled_from([16, 64]),                          # D
                   st.sampled_from([1, 2]))                            # D / R


@settings(max_examples=24, deadline=None, derandomize=True)
@given(shape=shapes, interleaved=st.booleans(), dtype=st.sampled_from(["f32", "bf16"]),
       fused=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_triton_and_reference_match_formula(shape, interleaved, dtype, fused, seed):
    T, (Hq, Hk), D, ratio = shape
    R = D // ratio
    for backend in ("triton", "reference"):
        q, k, qkv, positions, inv_freq = inputs(T, Hq, Hk, D, R, dtype, fused, seed)
        want_q, want_k = rope.rotated(q, positions, inv_freq, interleaved), rope.rotated(k, positions,
                                                                                         inv_freq, interleaved)
        v_before = qkv[:, (Hq + Hk) * D:].clone() if fused else None
        # small blocks: several trips over pairs and heads, with partial (masked) last blocks
        cfg = {"BLOCK_H": 2, "BLOCK_R": 8} if backend == "triton" else None
        rope.rope_kernel(q, k, positions, inv_freq, INTERLEAVED=interleaved, backend=backend, config=cfg)
        check_rotated(q, want_q, dtype, R)
        check_rotated(k, want_k, dtype, R)
        if fused:
            assert torch.equal(qkv[:, (Hq + Hk) * D:], v_before), "rope wrote into the v slice"


@pytest.mark.parametrize("dtype,interleaved,fused", [("bf16", False, True), ("f32", True, False)])
def test_rope_numba_matches_formula(dtype, interleaved, fused):
    cfg = {"BLOCK_H": 2, "BLOCK_R": 8}   # fixed: one numba compile per parametrization
    for T, Hq, Hk, D, R in [(17, 4, 2, 64, 32), (1, 2, 1, 16, 16), (3, 4, 1, 64, 64)]:
        q, k, qkv, positions, inv_freq = inputs(T, Hq, Hk, D, R, dtype, fused, seed=T)
        want_q, want_k = rope.rotated(q, positions, inv_freq, interleaved), rope.rotated(k, positions,
                                                                                         inv_freq, interleaved)
        rope.rope_kernel(q, k, positions, inv_freq, INTERLEAVED=interleaved, backend="numba", config=cfg)
        check_rotated(q, want_q, dtype, R)
        check_rotated(k, want_k, dtype, R)


@pytest.mark.parametrize("interleaved", [False, True])
def test_formula_matches_torch_eager_peer(interleaved):
    """rope.rotated (the kernel's spec) agrees with kilnx.ops_torch.rope_, the eager peer models use."""
    q, k, _, positions, inv_freq = inputs(5, 4, 2, 64, 32, "f32", False, seed=3)
    want_q, want_k = rope.rotated(q, positions, inv_freq, interleaved), rope.rotated(k, positions,
                                                                                     inv_freq, interleaved)
    ops_torch.rope_(q, k, positions, inv_freq, interleaved=interleaved)
    check_rotated(q, want_q, "f32", 32)
    check_rotated(k, want_k, "f32", 32)


def test_ops_entry_point_rotates_in_place_and_tuner_view_returns_outputs():
    from kilnx import ops
    q, k, _, positions, inv_freq = inputs(3, 4, 2, 16, 16, "f32", False, seed=5)
    want_q, want_k = rope.rotated(q, positions, inv_freq, False), rope.rotated(k, positions, inv_freq, False)
    ops.rope_(q, k, positions, inv_freq)
    check_rotated(q, want_q, "f32", 16)
    check_rotated(k, want_k, "f32", 16)
    # the tuner sees rope as a kernel returning what it rotated, compared with the spec's copies
    args = rope.rope_kernel.make_args({"T": 2, "Hq": 4, "Hk": 2, "D": 16, "R": 8, "dtype": "f32"}, "cpu")
    refs = rope.rope_kernel.reference(*args)
    outs = rope.rope_kernel.compile({"BLOCK_H": 4, "BLOCK_R": 8}, *args, backend="triton")(*args)
    assert outs[0] is args[0] and outs[1] is args[1]
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, rtol=2e-5, atol=2e-5)


def test_rope_rejects_rotary_wider_than_head():
    q, k, _, positions, _ = inputs(2, 2, 1, 16, 16, "f32", False, seed=0)
    with pytest.raises(ValueError, match="rotary width"):
        rope.rope_(q, k, positions, torch.ones(9))


def test_cos_sin_ops_on_every_backend():
    """kd.cos / kd.sin (added for rope): each backend against torch, including large angles."""
    import kilnx.dsl as kd

    @kd.kernel(tune={"BLOCK": kd.pow2(16, 64, default=32)})
    def cos_sin(x, *, BLOCK):
        i = kd.grid(kd.cdiv(x.shape[0], BLOCK)) * BLOCK + kd.arange(0, BLOCK)
        v = kd.load(x, i)
        c, s = kd.output(x.shape, kd.f32, name="c"), kd.output(x.shape, kd.f32, name="s")
        kd.store(c, i, kd.cos(v))
        kd.store(s, i, kd.sin(v))
        return c, s

    x = torch.cat([torch.linspace(-7, 7, 50), torch.tensor([1e3, 3e4, 1e5])])
    for backend in ("reference", "triton", "numba"):
        c, s = cos_sin(x, backend=backend)
        torch.testing.assert_close(c, x.double().cos().float(), rtol=0, atol=2e-6)
        torch.testing.assert_close(s, x.double().sin().float(), rtol=0, atol=2e-6)


# ---- rope + KV-cache write in one kernel ------------------------------------------------------------
@settings(max_examples=5, deadline=None, derandomize=True)
@given(shape=shapes, dtype=st.sampled_from(["f32", "bf16"]), interleaved=st.booleans(), batch=st.sampled_from([1, 2]))
def test_rope_and_cache_writes_what_rope_then_indexing_would(shape, dtype, interleaved, batch):
    """Against ops_torch (rope_, then k and v written by indexing): q rotated in place, the cache rows
    of each token's (row, position) hold rotated k and untouched v, and nothing else in the cache moves."""
    T, (Hq, Hk), D, ratio = shape
    R = D // ratio
    q, k, qkv, positions, inv_freq = inputs(T * batch, Hq, Hk, D, R, dtype, fused=True, seed=T * 7 + D)
    v = qkv[:, (Hq + Hk) * D:].view(T * batch, Hk, D)
    positions = torch.randperm(40)[:T * batch] if batch == 1 else torch.cat([torch.randperm(40)[:T]] * batch)
    rows = torch.arange(batch).repeat_interleave(T)
    S = 40
    caches = torch.randn(2, batch, Hk, S, D).to(DTYPES[dtype])
    want_q, want_k = q.clone(), k.clone()
    want_kc, want_vc = caches[0].clone(), caches[1].clone()
    ops_torch.rope_and_cache_(want_q, want_k, v.clone(), positions, rows, inv_freq, want_kc, want_vc,
                              interleaved=interleaved)
    for backend in ("triton", "reference") + (("numba",) if dtype == "bf16" and batch == 2 else ()):
        gq, gkc, gvc = q.clone(), caches[0].clone(), caches[1].clone()
        rope.rope_cache_kernel(gq, k, v, positions, rows, inv_freq, gkc, gvc, INTERLEAVED=interleaved,
                               backend=backend, config=None if backend != "reference" else {})
        check_rotated(gq, want_q, dtype, R)
        assert torch.equal(gvc, want_vc), f"{backend}: v cache"
        written = torch.zeros(batch, S, dtype=torch.bool)
        written[rows, positions] = True
        assert torch.equal(gkc.transpose(1, 2)[~written], want_kc.transpose(1, 2)[~written]), f"{backend}: stray writes"
        check_rotated(gkc.transpose(1, 2)[written], want_kc.transpose(1, 2)[written], dtype, R)


def test_rope_and_cache_on_numba():
    q, k, qkv, positions, inv_freq = inputs(4, 4, 2, 64, 32, "bf16", fused=True, seed=3)
    v = qkv[:, 6 * 64:].view(4, 2, 64)
    rows, positions = torch.tensor([0, 0, 1, 1]), torch.tensor([5, 6, 5, 7])
    caches = torch.zeros(2, 2, 2, 10, 64, dtype=torch.bfloat16)
    want_q, want_kc, want_vc = q.clone(), caches[0].clone(), caches[1].clone()
    ops_torch.rope_and_cache_(want_q, k.clone(), v.clone(), positions, rows, inv_freq, want_kc, want_vc)
    gq, gkc, gvc = q.clone(), caches[0].clone(), caches[1].clone()
    rope.rope_cache_kernel(gq, k, v, positions, rows, inv_freq, gkc, gvc, backend="numba")
    check_rotated(gq, want_q, "bf16", 32)
    check_rotated(gkc, want_kc, "bf16", 32)
    assert torch.equal(gvc, want_vc)
