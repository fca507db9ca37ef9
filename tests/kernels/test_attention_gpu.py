"""On the GPU: the split decode attention's prepared merge over more key ranges than one load takes
(run with -m gpu)."""

from __future__ import annotations

import pytest
import torch

from kilnx.kernels import attention as A
from kilnx.kernels import attention_split as AS
from kilnx.kernels import qmv_h2 as H

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.mark.parametrize("S,keys_per_split,pos", [(640, 16, (600, 20)), (40960, 512, (40000, 700)),
                                                  (8192, 512, (8000, 100))])
def test_the_prepared_merge_over_many_key_ranges_on_gpu(S, keys_per_split, pos):
    """40 and 80 ranges (chunked: MERGE_CHUNK at a time) and 16 (one load), with rows whose keys end in
    the first chunk and in a later one: the merge gives the reference's output in prepared form."""
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


@pytest.mark.parametrize("S,keys_per_split,B,Hk", [(256, 64, 1, 8), (2113, 128, 1, 8), (40960, 512, 2, 2)])
def test_the_merge_in_the_last_range_program_on_gpu(S, keys_per_split, B, Hk):
    """The one-launch split (each tile's last range program merges, by an acquire-release ticket) matches
    the two-launch split, and gives the same bits in each of 50 launches in a row: a range published late,
    or a stale line read by the merging program, would show as a difference; the slots end at zero."""
    g = torch.Generator().manual_seed(7)
    D = 128
    q = torch.randn(B, 1, 4 * Hk, D, generator=g).bfloat16().cuda()
    k_cache = torch.randn(B, Hk, S, D, generator=g).bfloat16().cuda()
    v_cache = torch.randn(B, Hk, S, D, generator=g).bfloat16().cuda()
    positions = torch.tensor([[S - 40 - 3 * b] for b in range(B)]).cuda()
    kw = A._kernel_kwargs(q, k_cache, D ** -0.5, None, None)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "KEYS_PER_SPLIT": keys_per_split}
    two = AS.attention_split(q, k_cache, v_cache, positions, kw, config=cfg)
    first = AS.attention_split_merged(q, k_cache, v_cache, positions, kw, config=cfg)
    torch.testing.assert_close(first.float(), two.float(), rtol=2e-2, atol=2e-3)
    first_p = AS.attention_split_merged(q, k_cache, v_cache, positions, kw, config=cfg, prepared=(8, 64))
    for _ in range(50):
        assert torch.equal(AS.attention_split_merged(q, k_cache, v_cache, positions, kw, config=cfg), first)
        again = AS.attention_split_merged(q, k_cache, v_cache, positions, kw, config=cfg, prepared=(8, 64))
        assert torch.equal(again.planes, first_p.planes) and torch.equal(again.sums, first_p.sums)
    want = H._x_of(*(t for i, t in enumerate(H._prep_spec(first.cpu().reshape(B, 4 * Hk * D).float(), PER=8, GROUP=64))
                     if i != 1))
    got = H._x_of(first_p.planes.cpu(), first_p.xs.cpu())
    assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()
    assert not AS.ticket_counter(q.device, B * Hk).any()
