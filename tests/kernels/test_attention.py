"""kilnx/kernels/attention.py: causal GQA attention over a KV cache against float64 formulas.

Over random shapes (B in {1, 2}, T in {1, 3, 17}, query/KV heads 1..4 with group sizes 1, 2, 3, 4,
head dims 16/64, sliding windows, logit softcap, fp32/bf16, rows of a batch at different positions):
the Triton kernel under the interpreter = the numpy reference interpreter = the float64 einsum
formula, and that formula = torch's scaled_dot_product_attention with an explicit mask. numba runs
on a few fixed specializations (each costs a numba compile on a cold cache).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx import ops_torch
from kilnx.kernels import attention as A
from attention_helpers import random_merge_parts

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
# bf16: probabilities are rounded to bf16 for the P @ V product (as on tensor cores) and the Triton
# interpreter truncates casts; outputs are averages of unit-scale values, so |error| stays < 2e-2
TOL = {"f32": (2e-5, 2e-5), "bf16": (2e-2, 2e-2)}
SMALL_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}   # several key blocks and query tiles in small tests


def inputs(B, T, Hq, Hk, D, dtype, seed, spare=5):
    """q, caches and positions: row b holds a context of ctx_b earlier tokens followed by the T new
    ones (so rows of one batch sit at different positions), the cache `spare` slots longer."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, 40, (B,), generator=g)
    positions = ctx[:, None] + torch.arange(T)[None, :]
    S = int(positions.max()) + 1 + spare
    dt = DTYPES[dtype]
    q = torch.randn(B, T, Hq, D, generator=g).to(dt)
    k_cache = torch.randn(B, Hk, S, D, generator=g).to(dt)
    v_cache = torch.randn(B, Hk, S, D, generator=g).to(dt)
    return q, k_cache, v_cache, positions


def run(q, k_cache, v_cache, positions, softcap, window, backend, config=SMALL_BLOCKS):
    kw = A._kernel_kwargs(q, k_cache, q.shape[-1] ** -0.5, softcap, window)
    return A.attention_kernel(q, k_cache, v_cache, positions, backend=backend, config=config, **kw)


def check(got, want, dtype):
    rtol, atol = TOL[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


heads = st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 1), (3, 1), (2, 2)])


@settings(max_examples=30, deadline=None, derandomize=True)
@given(B=st.sampled_from([1, 2]), T=st.sampled_from([1, 3, 17]), heads=heads, D=st.sampled_from([16, 64]),
       softcap=st.sampled_from([None, 2.0]), window=st.sampled_from([None, 1, 4, 9]),
       dtype=st.sampled_from(["f32", "bf16"]), seed=st.integers(0, 2**16))
def test_attention_triton_and_reference_match_formula(B, T, heads, D, softcap, window, dtype, seed):
    Hq, Hk = heads
    q, k_cache, v_cache, positions = inputs(B, T, Hq, Hk, D, dtype, seed)
    want = A.attention_formula(q, k_cache, v_cache, positions, D ** -0.5, softcap, window)
    for backend in ("triton", "reference"):
        check(run(q, k_cache, v_cache, positions, softcap, window, backend), want, dtype)


@pytest.mark.parametrize("dtype,softcap", [("bf16", None), ("f32", 2.0)])
def test_attention_numba_matches_formula(dtype, softcap):
    D = 64 if dtype == "bf16" else 16   # one head dim (tile width) per parametrization: one compile
    for B, T, Hq, Hk, window in [(2, 3, 4, 2, None), (1, 17, 3, 1, 5), (1, 1, 4, 1, None)]:
        q, k_cache, v_cache, positions = inputs(B, T, Hq, Hk, D, dtype, seed=T)
        want = A.attention_formula(q, k_cache, v_cache, positions, D ** -0.5, softcap, window)
        check(run(q, k_cache, v_cache, positions, softcap, window, "numba"), want, dtype)


@pytest.mark.parametrize("softcap,window", [(None, None), (3.0, None), (None, 6), (5.0, 3)])
def test_formula_matches_sdpa_and_eager_peer(softcap, window):
    """attention_formula (the kernel's spec) = torch's SDPA with an explicit boolean mask (softcap
    applied to the logits by hand, so SDPA sees pre-capped scores) = kilnx.ops_torch.attention."""
    B, T, Hq, Hk, D = 2, 5, 4, 2, 16
    q, k_cache, v_cache, positions = inputs(B, T, Hq, Hk, D, "f32", seed=11)
    scale = D ** -0.5
    want = A.attention_formula(q, k_cache, v_cache, positions, scale, softcap, window)

    S = k_cache.shape[2]
    j = torch.arange(S)
    visible = j <= positions[:, None, :, None]
    if window is not None:
        visible &= j > positions[:, None, :, None] - window
    qh = q.double().transpose(1, 2)                                       # (B, Hq, T, D)
    k = k_cache.double().repeat_interleave(Hq // Hk, dim=1)
    v = v_cache.double().repeat_interleave(Hq // Hk, dim=1)
    if softcap is None:
        sdpa = F.scaled_dot_product_attention(qh, k, v, attn_mask=visible, scale=scale)
    else:
        # SDPA has no softcap: feed it logits whose scaled product is the capped score
        logits = softcap * torch.tanh(qh @ k.transpose(-1, -2) * scale / softcap)
        probs = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)
        sdpa = probs @ v
    torch.testing.assert_close(want.double(), sdpa.transpose(1, 2).float().double(), rtol=1e-5, atol=1e-5)
    peer = ops_torch.attention(q, k_cache, v_cache, positions, scale, softcap=softcap, window=window)
    torch.testing.assert_close(want, peer, rtol=1e-5, atol=1e-5)


def test_decode_group_packing_and_positions_read_in_kernel():
    """Decode (T = 1) with llama-3's group of 4: one compiled kernel, run again after the positions
    (and nothing else) change, as under CUDA-graph replay, follows the new positions."""
    B, T, Hq, Hk, D = 2, 1, 8, 2, 64
    q, k_cache, v_cache, positions = inputs(B, T, Hq, Hk, D, "f32", seed=7, spare=30)
    kw = A._kernel_kwargs(q, k_cache, D ** -0.5, None, None)
    fn = A.attention_kernel.compile(A.attention_kernel.default_config(q, k_cache, v_cache, positions),
                                    q, k_cache, v_cache, positions, backend="triton", **kw)
    for step in range(3):
        pos = positions + 10 * step
        want = A.attention_formula(q, k_cache, v_cache, pos, D ** -0.5)
        check(fn(q, k_cache, v_cache, pos, **kw), want, "f32")


def test_ops_entry_point_and_tuner_view():
    from kilnx import ops
    q, k_cache, v_cache, positions = inputs(1, 3, 4, 2, 16, "bf16", seed=3)
    want = A.attention_formula(q, k_cache, v_cache, positions, 0.3, 4.0, 5)
    check(ops.attention(q, k_cache, v_cache, positions, 0.3, softcap=4.0, window=5), want, "bf16")
    # the tuner compiles and checks from make_args alone: the head-dim tile and scale are derived
    problem = {"B": 1, "T": 2, "Hq": 4, "Hk": 1, "D": 16, "S": 24, "ctx": 20, "dtype": "f32"}
    args = A.attention_kernel.make_args(problem, "cpu")
    assert A.attention_kernel.key(*args) == "B=1,T=2,Hq=4,Hk=1,D=16"
    got = A.attention_kernel.compile(SMALL_BLOCKS, *args, backend="triton")(*args)
    check(got, A.attention_kernel.reference(*args), "f32")


def test_attention_rejects_bad_head_counts_and_window():
    q, k_cache, v_cache, positions = inputs(1, 1, 3, 2, 16, "f32", seed=0)
    with pytest.raises(ValueError, match="multiple"):
        A.attention(q, k_cache, v_cache, positions, 0.25)
    q, k_cache, v_cache, positions = inputs(1, 1, 2, 1, 16, "f32", seed=0)
    with pytest.raises(ValueError, match="window"):
        A.attention(q, k_cache, v_cache, positions, 0.25, window=0)


# ---- split over keys (flash-decoding): partial softmaxes per key range, merged ------------------------
@settings(max_examples=12, deadline=None, derandomize=True)
@given(B=st.sampled_from([1, 2]), T=st.sampled_from([1, 3]), heads=heads, softcap=st.sampled_from([None, 2.0]),
       window=st.sampled_from([None, 4, 9]), keys_per_split=st.sampled_from([16, 32]),
       dtype=st.sampled_from(["f32", "bf16"]), seed=st.integers(0, 2**16))
def test_split_attention_matches_formula(B, T, heads, softcap, window, keys_per_split, dtype, seed):
    """Ranges of 16-32 keys over contexts up to 45: several ranges per row, some past every query's
    position (no keys: weight 0 in the merge), windows that start inside a range."""
    from kilnx.kernels import attention_split as AS
    Hq, Hk = heads
    D = 16
    q, k_cache, v_cache, positions = inputs(B, T, Hq, Hk, D, dtype, seed, spare=20)
    want = A.attention_formula(q, k_cache, v_cache, positions, D ** -0.5, softcap, window)
    kw = A._kernel_kwargs(q, k_cache, D ** -0.5, softcap, window)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "KEYS_PER_SPLIT": keys_per_split}
    for backend in ("triton", "reference"):
        check(AS.attention_split(q, k_cache, v_cache, positions, kw, config=cfg, backend=backend), want, dtype)


def test_split_attention_on_numba_and_the_split_rule():
    from kilnx.kernels import attention_split as AS
    q, k_cache, v_cache, positions = inputs(1, 1, 4, 2, 16, "f32", seed=4, spare=30)
    want = A.attention_formula(q, k_cache, v_cache, positions, 0.25, None, None)
    kw = A._kernel_kwargs(q, k_cache, 0.25, None, None)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "KEYS_PER_SPLIT": 16}
    check(AS.attention_split(q, k_cache, v_cache, positions, kw, config=cfg, backend="numba"), want, "f32")
    assert not AS.use_split(q, k_cache)                   # the CPU keeps the one-pass kernel
    big = torch.zeros(1, 8, 4096, 128)
    # the power of two nearest an even share: 4096 x 8 / 132 = 248 -> 256 keys (8 x 16 programs)
    assert AS.keys_per_split(torch.zeros(1, 1, 32, 128), big, programs=132) == 256
    assert AS.keys_per_split(torch.zeros(1, 1, 32, 128), torch.zeros(1, 8, 2113, 128), programs=132) == 128
    assert AS.keys_per_split(torch.zeros(1, 1, 32, 128), big, programs=16) == 2048
    short = torch.zeros(1, 8, 256, 128)                   # a short cache: 64 keys a range at the least
    assert AS.keys_per_split(torch.zeros(1, 1, 32, 128), short, programs=132) == 64


@pytest.mark.parametrize("backend", ["triton", "reference", "numba"])
def test_split_attention_merge_writes_the_o_projections_prepared_input(backend):
    """With prepared=(PER, GROUP) the merge writes qmv_h2's input form of (B*T, Hq*D) directly: the
    same activations as merging, then preparing."""
    from kilnx.kernels import attention_split as AS
    from kilnx.kernels import qmv_h2 as H
    q, k_cache, v_cache, positions = inputs(2, 1, 4, 2, 64, "f32", seed=9, spare=30)
    kw = A._kernel_kwargs(q, k_cache, 0.125, None, None)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "KEYS_PER_SPLIT": 16}
    for fmt in ((8, 64), (4, 32)):
        got = AS.attention_split(q, k_cache, v_cache, positions, kw, config=cfg, backend=backend, prepared=fmt)
        out = AS.attention_split(q, k_cache, v_cache, positions, kw, config=cfg, backend="reference")
        want = H._prep_spec(out.reshape(2, 4 * 64).float(), PER=fmt[0], GROUP=fmt[1])
        assert got.shape == (2, 256) and got.format == fmt
        assert torch.equal(got.xs, want[2])
        torch.testing.assert_close(H._x_of(got.planes, got.xs), H._x_of(want[0], want[2]), rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "numba"])
def test_the_prepared_merge_of_more_ranges_than_one_load_takes(backend):
    """At long contexts the prepared merge reads the key ranges MERGE_CHUNK at a time: 40 ranges of 16 keys
    with keys in both chunks (one row at position 600, one at 20) merge as the reference does."""
    from kilnx.kernels import attention_split as AS
    from kilnx.kernels import qmv_h2 as H
    g = torch.Generator().manual_seed(4)
    S, D = 640, 64
    q = torch.randn(2, 1, 4, D, generator=g)
    k_cache, v_cache = torch.randn(2, 2, S, D, generator=g), torch.randn(2, 2, S, D, generator=g)
    positions = torch.tensor([[600], [20]])
    kw = A._kernel_kwargs(q, k_cache, 0.125, None, None)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "KEYS_PER_SPLIT": 16}
    assert S // 16 > AS.MERGE_CHUNK
    got = AS.attention_split(q, k_cache, v_cache, positions, kw, config=cfg, backend=backend, prepared=(8, 64))
    out = AS.attention_split(q, k_cache, v_cache, positions, kw, config=cfg, backend="reference")
    want = H._prep_spec(out.reshape(2, 4 * D).float(), PER=8, GROUP=64)
    assert torch.equal(got.xs, want[2])
    torch.testing.assert_close(H._x_of(got.planes, got.xs), H._x_of(want[0], want[2]), rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("ranges,backend", [(1, "triton"), (2, "triton"), (3, "triton"), (5, "triton"),
                                            (2, "numba")])
def test_the_prepared_merge_of_random_partial_results(ranges, backend):
    """Partial results with a range without keys: the prepared merge gives the merge spec's values. Below 4 ranges
    its tile takes masked ranges (PREP_MIN_RANGES: triton 3.6 compiled the 2-range tile wrong for sm_90), which must
    weigh 0."""
    from kilnx.kernels import attention_split as AS
    from kilnx.kernels import qmv_h2 as H
    parts, q, want = random_merge_parts(ranges)
    x = AS.merge(parts, q, (8, 64), backend=backend)
    torch.testing.assert_close(H._x_of(x.planes, x.xs), want.flatten(2).flatten(0, 1), rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("D,fmt", [(64, (8, 64)), (128, (8, 64)), (256, (8, 64)), (128, (4, 32)), (96, (8, 32)),
                                   (96, (4, 32))])
@pytest.mark.parametrize("ranges", [1, 3, 17, 40])
def test_the_merge_in_prepared_form_for_every_head_width(ranges, fmt, D):
    """merge() in the o projection's prepared format gives the merge spec's values for heads the prepared merge takes
    (whole groups, a power of two of words) and for those it does not (a 96-wide head in groups of 32: 12 or 24
    words; it merges plainly, then preps), over one load of the ranges and the chunked loads past MERGE_CHUNK."""
    from kilnx.kernels import attention_split as AS
    from kilnx.kernels import qmv_h2 as H
    parts, q, want = random_merge_parts(ranges, B=2, Hq=2, D=D)
    x = AS.merge(parts, q, fmt, backend="triton")
    assert x.format == fmt
    torch.testing.assert_close(H._x_of(x.planes, x.xs), want.flatten(2).flatten(0, 1), rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(x.sums, H._x_of(x.planes, x.xs).reshape(*x.sums.shape, -1).sum(-1), rtol=1e-3,
                               atol=1e-3)


def test_which_heads_the_prepared_merge_takes():
    from kilnx.kernels.attention_split import merges_prepared
    assert merges_prepared(128, 8, 64) and merges_prepared(64, 4, 32) and merges_prepared(256, 8, 128)
    assert not merges_prepared(96, 8, 32)      # whole groups, but 12 words
    assert not merges_prepared(96, 8, 64)      # not whole groups


# ---- parked queries (runtime/kv_cache.py's parking slot) ---------------------------------------------
def parked_inputs(B, T, Hq, Hk, D, dtype, seed, parked_rows):
    """inputs() with the cache's last slot as the parking slot: the tokens of `parked_rows` (a whole row: a
    tokenless row of a batched step) and a random tail of the others' tokens (a prompt's padding) sit there."""
    q, k_cache, v_cache, positions = inputs(B, T, Hq, Hk, D, dtype, seed, spare=20)
    limit = k_cache.shape[2] - 1
    g = torch.Generator().manual_seed(seed + 1)
    positions = positions.clone()
    for b in range(B):
        keep = 0 if b in parked_rows else int(torch.randint(1, T + 1, (1,), generator=g))
        positions[b, keep:] = limit
    return q, k_cache, v_cache, positions, limit


@settings(max_examples=12, deadline=None, derandomize=True)
@given(B=st.sampled_from([1, 2]), T=st.sampled_from([1, 3, 17]), heads=heads, window=st.sampled_from([None, 4]),
       parked_rows=st.sampled_from([(), (0,), (1,)]), split=st.sampled_from([0, 16]),
       dtype=st.sampled_from(["f32", "bf16"]), seed=st.integers(0, 2**16))
def test_parked_queries_see_nothing_and_the_rest_are_untouched(B, T, heads, window, parked_rows, split, dtype, seed):
    """A query at `limit` (the parking slot) attends to nothing: its output is 0 (before, it attended to every key
    of the cache). The other queries' outputs are the formula's without parking; the one-pass and the split
    kernels on Triton and the reference, and the eager peer, agree."""
    from kilnx.kernels import attention_split as AS
    Hq, Hk = heads
    D = 16
    q, k_cache, v_cache, positions, limit = parked_inputs(B, T, Hq, Hk, D, dtype, seed, parked_rows)
    scale = D ** -0.5
    want = A.attention_formula(q, k_cache, v_cache, positions, scale, None, window, limit=limit)
    is_parked = positions >= limit
    assert torch.equal(want[is_parked], torch.zeros_like(want[is_parked]))
    free = A.attention_formula(q, k_cache, v_cache, positions, scale, None, window)
    assert torch.equal(want[~is_parked], free[~is_parked])
    kw = A._kernel_kwargs(q, k_cache, scale, None, window, limit)
    for backend in ("triton", "reference"):
        if split:
            cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "KEYS_PER_SPLIT": split}
            got = AS.attention_split(q, k_cache, v_cache, positions, kw, config=cfg, backend=backend)
        else:
            got = A.attention_kernel(q, k_cache, v_cache, positions, backend=backend, config=SMALL_BLOCKS, **kw)
        check(got, want, dtype)
        assert torch.equal(got[is_parked], torch.zeros_like(got[is_parked]))
    peer = ops_torch.attention(q, k_cache, v_cache, positions, scale, window=window, limit=limit)
    check(peer, want, dtype)


def test_parked_queries_on_numba():
    q, k_cache, v_cache, positions, limit = parked_inputs(2, 3, 4, 2, 16, "f32", seed=5, parked_rows=(1,))
    want = A.attention_formula(q, k_cache, v_cache, positions, 0.25, None, None, limit=limit)
    kw = A._kernel_kwargs(q, k_cache, 0.25, None, None, limit)
    check(A.attention_kernel(q, k_cache, v_cache, positions, backend="numba", config=SMALL_BLOCKS, **kw), want, "f32")
    with pytest.raises(ValueError, match="parking limit"):
        A._kernel_kwargs(q, k_cache, 0.25, None, None, -1)
