"""On the GPU: the split decode attention's prepared merge over more key ranges than one load takes, and parked
queries over a long cache (run with -m gpu)."""

from __future__ import annotations

import pytest
import torch

from kilnx.kernels import attention as A
from kilnx.kernels import attention_split as AS
from kilnx.kernels import qmv_h2 as H
from attention_helpers import random_merge_parts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.mark.parametrize("S,keys_per_split,pos", [(640, 16, (600, 20)), (40960, 512, (40000, 700)),
                                                  (8192, 512, (8000, 100)), (136, 128, (128, 20)), (100, 128, (90, 5))])
def test_the_prepared_merge_over_many_key_ranges_on_gpu(S, keys_per_split, pos):
    """40 and 80 ranges (chunked: MERGE_CHUNK at a time) and 16 (one load), with rows whose keys end in
    the first chunk and in a later one: the merge gives the reference's output in prepared form. And 2 ranges and 1:
    the 2-range case failed on the H200 before PREP_MIN_RANGES (bench/results/profiles/
    2026-12-07_h200_attention_gpu_tests_s37.log: the range count, not the 16 rows of session 34, broke it)."""
    g = torch.Generator().manual_seed(5)
    D = 128
    q = torch.randn(2, 1, 8, D, generator=g).bfloat16().cuda()
    k_cache = torch.randn(2, 2, S, D, generator=g).bfloat16().cuda()
    v_cache = torch.randn(2, 2, S, D, generator=g).bfloat16().cuda()
    positions = torch.tensor([[pos[0]], [pos[1]]]).cuda()
    kw = A._kernel_kwargs(q, k_cache, D ** -0.5, None, None)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 64 if keys_per_split >= 64 else 16, "KEYS_PER_SPLIT": keys_per_split}
    got = AS.attention_split(q, k_cache, v_cache, positions, kw, config=cfg, prepared=(8, 64))
    out = AS.attention_split(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), positions.cpu(), kw,
                             config=cfg, backend="reference")
    want = H._x_of(*(t for i, t in enumerate(H._prep_spec(out.reshape(2, 8 * D).float(), PER=8, GROUP=64))
                     if i != 1))
    err = (H._x_of(got.planes.cpu(), got.xs.cpu()) - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), err


@pytest.mark.parametrize("ranges", [1, 2, 3, 4, 5, 8])
def test_both_merges_of_random_partial_results_on_gpu(ranges):
    """Partial results with a range without keys, merged by each merge against the spec, the prepared one read back
    as x: 2 ranges is the count whose prepared tile compiled wrong (PREP_MIN_RANGES); the others are its neighbours."""
    parts, q, want = random_merge_parts(ranges)
    parts, q = [t.cuda() for t in parts], q.cuda()
    torch.testing.assert_close(AS.attention_merge(*parts, q).float().cpu(), want, rtol=1e-2, atol=1e-2)
    x = AS.merge(parts, q, (8, 64))
    torch.testing.assert_close(H._x_of(x.planes, x.xs).cpu(), want.flatten(2).flatten(0, 1), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fmt", [(8, 32), (8, 64), (8, 128), (4, 32), (4, 64)])
@pytest.mark.parametrize("ranges", [1, 2, 5, 17, 40])
def test_the_prepared_merge_configs_of_the_space_on_gpu(ranges, fmt):
    """The prepared merge in each format the o projection takes (4- and 8-bit codes, groups of 32-128) with each
    number of warps of its space, over ranges that take masked tile rows (1, 2, 5), one load (17) and chunks (40):
    triton 3.6 compiled some of this tile's shapes wrong for sm_90 (2 ranges; 2 groups of 32 a program in session
    41), which only a GPU shows."""
    parts, q, want = random_merge_parts(ranges)
    parts, q = [t.cuda() for t in parts], q.cuda()
    for warps in MERGE_WARPS:
        planes, sums, xs = AS.attention_merge_prep(*parts, q, PER=fmt[0], GROUP=fmt[1], config={"num_warps": warps})
        x = H._x_of(planes, xs)
        torch.testing.assert_close(x.cpu(), want.flatten(2).flatten(0, 1), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"num_warps {warps}: {m}")
        # the group sums (the o projection's bias term) are those of the values stored
        torch.testing.assert_close(sums, x.reshape(*sums.shape, -1).sum(-1), rtol=1e-3, atol=1e-3,
                                   msg=lambda m: f"sums, num_warps {warps}: {m}")


MERGE_WARPS = list(AS.attention_merge_prep.space.params["num_warps"].values)   # the prepared merge's space


@pytest.mark.parametrize("T", [1, 16])
def test_parked_queries_over_a_long_cache_on_gpu(T):
    """A 32k-slot cache (the split kernel at T = 1, the one-pass kernel at 16 tokens): a row parked whole and a row
    whose tail is padding at the parking slot; parked queries give 0, the others the reference's output."""
    g = torch.Generator().manual_seed(7)
    S, D, B = 32768, 128, 2
    q = torch.randn(B, T, 8, D, generator=g).bfloat16().cuda()
    k_cache = torch.randn(B, 2, S, D, generator=g).bfloat16().cuda()
    v_cache = torch.randn(B, 2, S, D, generator=g).bfloat16().cuda()
    limit = S - 1
    positions = torch.tensor([[limit] * T, [300 + t if t < T // 2 + 1 else limit for t in range(T)]]).cuda()
    got = A.attention(q, k_cache, v_cache, positions, D ** -0.5, limit=limit).float().cpu()
    want = A.attention_formula(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), positions.cpu(),
                               D ** -0.5, limit=limit)
    parked = (positions >= limit).cpu()
    assert torch.equal(got[parked], torch.zeros_like(got[parked]))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("merge_warps", [None, *MERGE_WARPS])
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_o_projection_on_qmv_h2_after_the_prepared_merge_on_gpu(rows, merge_warps):
    """llama-3.1-8b's heads and o weight at 8 and 16 rows over a 137-slot cache (the step trial's engine), o on
    qmv_h2 fed by the merge's prepared output: the product of the merged attention (session 34's step trial saw
    a decode step's logits off by 1.3 relative with o on qmv_h2 at 16 rows)."""
    from kilnx.kernels.prepared import PreparedX, qmatmul_prepared
    from kilnx.quant import QWeight
    g = torch.Generator().manual_seed(rows)
    Hq, Hk, D, S = 32, 8, 128, 137
    q = torch.randn(rows, 1, Hq, D, generator=g).bfloat16().cuda()
    k_cache = torch.randn(rows, Hk, S, D, generator=g).bfloat16().cuda()
    v_cache = torch.randn(rows, Hk, S, D, generator=g).bfloat16().cuda()
    positions = torch.full((rows, 1), 128).cuda()
    kw = A._kernel_kwargs(q, k_cache, D ** -0.5, None, None, S - 1)
    x = AS.attention_split(q, *AS.context_view(k_cache, v_cache, kw), positions, kw, prepared=(8, 64))
    plain = AS.attention_split(q, *AS.context_view(k_cache, v_cache, kw), positions, kw)
    if merge_warps is not None:     # the merge's other configs on the same partial results
        parts = AS.attention_split_kernel(q, *AS.context_view(k_cache, v_cache, kw), positions, **kw)
        x = PreparedX(*AS.attention_merge_prep(*parts, q, PER=8, GROUP=64, config={"num_warps": merge_warps}),
                      q.dtype)
    # which side departs (on the H100 at 16 rows the two merges differed, bench/results/profiles/*_s36.log): the
    # plain merge against the float formula first, then the prepared one against each
    formula = A.attention_formula(q.cpu().float(), k_cache.cpu().float(), v_cache.cpu().float(), positions.cpu(),
                                  D ** -0.5, limit=S - 1)
    torch.testing.assert_close(plain.float().cpu(), formula, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(H._x_of(x.planes, x.xs).cpu(), formula.reshape(rows, Hq * D), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(H._x_of(x.planes, x.xs), plain.reshape(rows, Hq * D).float(), rtol=0, atol=1e-6)
    w = QWeight.quantize((torch.randn(Hq * D, Hq * D, generator=g) * 0.02).bfloat16(), bits=4, group_size=64).to("cuda")
    got = qmatmul_prepared(x, w).float()
    want = plain.reshape(rows, Hq * D).float() @ w.dequantize(torch.float32).T
    err = (got - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), (err, want.abs().max().item())
