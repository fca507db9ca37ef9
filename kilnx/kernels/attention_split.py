"""Decode attention split over the keys (flash-decoding): partial softmaxes per key range, then a merge.

Why: at decode (one query tile per batch row and KV head) `attention_kernel` runs B * Hk programs —
8 for llama-3.1-8b at batch 1, on a GPU of 132 SMs — each streaming its whole K/V history. On the
H200 a 2k-token context made the decode step ~1 ms slower than a short one (30 us per layer). Here
each (query tile, KV head) pair is also split into ranges of KEYS_PER_SPLIT keys, one program each,
which write their unnormalized accumulator with its running max and sum; `attention_merge` rescales
the ranges to a common max and normalizes. A range past the query's position has no keys: it writes
max = MASKED_MAX and sum = 0, which the merge weighs by exp(MASKED_MAX - max) = 0. The number of
ranges is fixed by the cache length, so one CUDA graph serves every step.
"""

from __future__ import annotations

import math
import os

import torch

import kilnx.dsl as kd
from kilnx.kernels.attention import (MASKED_MAX, NO_WINDOW, _attn_key, _attn_problem_args, attend, attention_formula,
                                     parked, parked_formula, query_tile, visible_keys)
from kilnx.kernels.sizes import NO_LIMIT, pow2_at_least


def _split_spec(q, k_cache, v_cache, positions, *, scale, cap=0.0, window=NO_WINDOW, limit=NO_LIMIT, SOFTCAP=False,
                KEYS_PER_SPLIT, **_):
    """Per key range s: acc_s = sum_j exp(score_j - m_s) v_j, m_s = max score, l_s = sum exp(score_j - m_s)."""
    B, T, Hq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    ns = -(-S // KEYS_PER_SPLIT)
    k = k_cache.double().repeat_interleave(Hq // Hk, dim=1)
    v = v_cache.double().repeat_interleave(Hq // Hk, dim=1)
    scores = torch.einsum("bthd,bhsd->bths", q.double(), k) * scale      # (B, T, Hq, S)
    if SOFTCAP:
        scores = cap * torch.tanh(scores / cap)
    j = torch.arange(S, device=q.device)
    pos = parked_formula(positions.to(q.device), limit)[:, :, None, None]
    scores = scores.masked_fill(~((j <= pos) & (j > pos - window)), float("-inf"))
    acc = torch.zeros(ns, B, T, Hq, D, dtype=torch.float64, device=q.device)
    mx = torch.full((ns, B, T, Hq), MASKED_MAX, dtype=torch.float64, device=q.device)
    sm = torch.zeros(ns, B, T, Hq, dtype=torch.float64, device=q.device)
    for s in range(ns):
        part = scores[..., s * KEYS_PER_SPLIT:(s + 1) * KEYS_PER_SPLIT]
        m = part.amax(-1).clamp(min=MASKED_MAX)
        p = torch.exp(part - m[..., None])
        mx[s], sm[s] = m, p.sum(-1)
        acc[s] = torch.einsum("bths,bhsd->bthd", p, v[:, :, s * KEYS_PER_SPLIT:(s + 1) * KEYS_PER_SPLIT])
    return acc.float(), mx.float(), sm.float()


def _split_default(q, k_cache, v_cache, positions, **_):
    # 128 keys a tile of an fp8 cache (the bytes of 64 bf16 ones; at 8k keys on the H100 20.4 us against 22.0 with
    # 64: bench/results/2026-12-06_h100_attention_long_s29.csv), 64 of any other
    keys = keys_per_split(q, k_cache)
    return {"BLOCK_M": max(16, pow2_at_least(q.shape[1] * q.shape[2] // k_cache.shape[1])),
            "BLOCK_N": min(128 if k_cache.element_size() == 1 else 64, keys), "KEYS_PER_SPLIT": keys,
            "num_warps": 4, "num_stages": 3}


def keys_per_split(q, k_cache, *, programs: int | None = None) -> int:
    """A power of two (>= 64) of keys per range so that the (batch row, KV head, range) programs number
    about the SMs, or `programs`. Measured on the H200 (llama-3.1-8b heads, one token, split + the
    prepared merge; bench/results/2026-12-03_h200_attention_decode_s11.csv): a 2113-slot cache took 14.7 us
    with 128 keys per range (136 programs), 15.1 with 256, 16.3 with 64; a 256-slot cache 8.7 us with
    64 (32 programs), 9.5 with 128, against 10.4 for the one-program kernel and its prep. The power of two
    nearest the even share, not the one below it: on the H100 (bench/results/2026-12-06_h100_attention_long_s29.csv)
    an 8256-slot cache took 25.6 us with 512 keys a range (17 ranges) against 28.2 with 256, a 32832-slot one 63.1
    with 2048 against 66.9 with 1024 (bf16; fp8 20.4 against 24.4 at 8k)."""
    B, Hk, S = q.shape[0], k_cache.shape[1], k_cache.shape[2]
    if programs is None:
        programs = _sm_count(q.device) if q.is_cuda else 8
    want = max(S * B * Hk / programs, 1.0)
    return min(max(64, 1 << round(math.log2(want))), 8192)


_SMS: dict = {}


def _sm_count(device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def _split_key(q, k_cache, v_cache, positions, **_):
    """attention's bucket and the cache's length as the power of two nearest it: the keys per range that suit one
    length (about one program per SM, keys_per_split) do not suit another, so a tuned config serves its own
    length class only (exact_buckets, below)."""
    return {**_attn_key(q, k_cache, v_cache, positions), "S": 1 << round(math.log2(max(k_cache.shape[2], 1)))}


# One warp a program (no cross-warp row max and sum: 2 bar.syncs a 64-key block in the sm_90 PTX against 7 at 2 and 4
# warps) lost at every length and range size on the H100, split + prepared merge: 11.87 us against 8.48 for the
# default at 256 slots, 18.75 against 15.14 at 2113, 28.70 against 26.05 at 8256
# (bench/results/2026-12-07_h100_attention_warps_s41.csv): not in the space.
TUNE = {"BLOCK_M": kd.pow2(16, 64, default=16), "BLOCK_N": kd.pow2(16, 128, default=64),
        "KEYS_PER_SPLIT": kd.pow2(16, 8192, default=512),
        "num_warps": kd.choice(2, 4, 8, default=4), "num_stages": kd.choice(1, 2, 3, 4, default=3)}
CONSTRAINTS = [lambda KEYS_PER_SPLIT, BLOCK_N: KEYS_PER_SPLIT >= BLOCK_N]


@kd.kernel(
    tune=TUNE, constraints=CONSTRAINTS,
    key=_split_key, default=_split_default, spec=_split_spec,
    specialize=lambda q, k_cache, v_cache, positions: {"BLOCK_D": max(pow2_at_least(q.shape[3]), 16),
                                                       "scale": q.shape[3] ** -0.5})
def attention_split_kernel(q, k_cache, v_cache, positions, *, scale: float, cap: float = 0.0, window: int = NO_WINDOW,
                           limit: int = NO_LIMIT, BLOCK_D: kd.constexpr = 64, SOFTCAP: kd.constexpr = False, BLOCK_M,
                           BLOCK_N, KEYS_PER_SPLIT):
    B, T, Hq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hk
    NS = kd.cdiv(S, KEYS_PER_SPLIT)
    pid_m, pid_bh, split = kd.grid(kd.cdiv(T * group, BLOCK_M), B * Hk, NS)
    b = pid_bh // Hk
    kv_head = pid_bh % Hk
    q_tile, token, head, row_valid, d = query_tile(q, pid_m, kv_head, b, group, T, BLOCK_M, BLOCK_D)
    pos = parked(kd.load(positions, b, token, other=-1), limit)
    return _attend_range(q_tile, token, head, row_valid, d, pos, k_cache, v_cache, b, kv_head, split, B, T, Hq, D,
                         scale=scale, cap=cap, window=window, SOFTCAP=SOFTCAP, BLOCK_N=BLOCK_N,
                         KEYS_PER_SPLIT=KEYS_PER_SPLIT)


def _attend_range(q_tile, token, head, row_valid, d, pos, k_cache, v_cache, b, kv_head, split, B, T, Hq, D, *,
                  scale, cap, window, SOFTCAP, BLOCK_N, KEYS_PER_SPLIT):
    """One program's key range: its partial accumulator, max and sum stored as range `split`. (Letting the merge in
    after the key loop rather than at the grid sync, though the ranges number about the SMs, was even or lost on the
    H100: llama-3.2-1b 1676.3-1681.6 tok/s against 1682.1-1685.5 at prompt 128, 1549.9-1554.4 against 1558.9-1565.0
    at 2048, llama-3.1-8b 412.1-413.2 against 413.9-415.6 at 2048: 2026-12-07_h100_e2e_attention_trigger_*_s39.csv.)"""
    S = k_cache.shape[2]
    NS = kd.cdiv(S, KEYS_PER_SPLIT)
    key_start, key_stop = visible_keys(pos, row_valid, S, window, BLOCK_N)
    lo = split * KEYS_PER_SPLIT                 # a multiple of BLOCK_N, as key_start is
    hi = kd.minimum(lo + KEYS_PER_SPLIT, S)
    acc, row_max, row_sum = attend(q_tile, pos, k_cache, v_cache, b, kv_head, d, kd.maximum(key_start, lo),
                                   kd.minimum(key_stop, hi), hi, scale=scale, cap=cap, window=window,
                                   SOFTCAP=SOFTCAP, BLOCK_N=BLOCK_N)
    part_acc = kd.output((NS, B, T, Hq, D), kd.f32, name="part_acc")
    kd.store(part_acc, split, b, token[:, None], head[:, None], d[None, :], acc)
    part_max = kd.output((NS, B, T, Hq), kd.f32, name="part_max")
    kd.store(part_max, split, b, token, head, row_max)
    part_sum = kd.output((NS, B, T, Hq), kd.f32, name="part_sum")
    kd.store(part_sum, split, b, token, head, row_sum)
    return part_acc, part_max, part_sum


def _merge_spec(part_acc, part_max, part_sum, q, **_):
    m = part_max.double().amax(0)
    w = torch.exp(part_max.double() - m)
    total = (w * part_sum.double()).sum(0)
    out = (w[..., None] * part_acc.double()).sum(0) / torch.where(total > 0, total, 1.0)[..., None]
    return out.to(q.dtype)


@kd.kernel(tune={"num_warps": kd.choice(1, 2, 4, default=2)},
           key=lambda part_acc, *_, **__: {"NS": part_acc.shape[0], "D": part_acc.shape[-1]}, spec=_merge_spec,
           specialize=lambda part_acc, part_max, part_sum, q: {"BLOCK_S": pow2_at_least(part_acc.shape[0]),
                                                               "BLOCK_D": max(pow2_at_least(part_acc.shape[4]), 16)})
def attention_merge(part_acc, part_max, part_sum, q, *, BLOCK_S: kd.constexpr, BLOCK_D: kd.constexpr):
    """out[b, t, h] = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s), in q.dtype."""
    B, T, Hq, D = q.shape
    b, t, h, top, w, norm = _merge_weights(part_max, part_sum, B, T, Hq, BLOCK_S)
    d = kd.arange(0, BLOCK_D)
    s = kd.arange(0, BLOCK_S)
    acc = kd.sum(kd.load(part_acc, s[:, None], b, t, h, d[None, :]) * w[:, None], axis=0)
    out = kd.output((B, T, Hq, D), q.dtype)
    kd.store(out, b, t, h, d, acc * norm)
    return out


def _merge_weights(part_max, part_sum, B, T, Hq, BLOCK_S: int):
    """The merge of one (row, token, head) per program: (b, t, h, the ranges' largest max, each range's
    weight exp(m_s - max) as a (BLOCK_S,) tile, 1 / sum_s weight_s l_s). A range without keys has
    m = MASKED_MAX and l = 0: weight 0. A head that saw no key at all divides by 1, not 0."""
    r = kd.grid(B * T * Hq)
    b, t, h = r // (T * Hq), (r // Hq) % T, r % Hq
    s = kd.arange(0, BLOCK_S)
    m = kd.load(part_max, s, b, t, h, other=MASKED_MAX)
    top = kd.max(m)
    w = kd.exp(m - top)
    total = kd.sum(w * kd.load(part_sum, s, b, t, h))
    return b, t, h, top, w, 1.0 / kd.where(total > 0, total, 1.0)


MERGE_CHUNK = 32   # key ranges the prepared merge reads per load
# The prepared merge's (ranges, DW, PER/2) tile never has 2 ranges: compiled by triton 3.6 for sm_90, a 2-range
# tile summed to wrong values (H200 and H100: 10.8-13.3% of elements off by up to 0.5 at 16 rows of a 137-slot
# cache; bench/results/profiles/*_attention_gpu_tests_s3[67].log) where 1, 3 and 16 ranges (tiles of 1, 4, 16)
# did not, and the interpreter was right at all. Triton 3.6 lays the 2-range tile out otherwise (2 lanes on the ranges,
# the warps across PER/2; triton 3.9 gives it the 4-range layout), and the sums then reshaped into groups come out
# wrong. A masked third and fourth range cost two predicated-off loads
PREP_MIN_RANGES = 4


def _merge_prep_spec(part_acc, part_max, part_sum, q, *, PER, GROUP, **_):
    from kilnx.kernels.qmv_h2 import _prep_spec
    out = _merge_spec(part_acc, part_max, part_sum, q)
    B, T, Hq, D = out.shape
    return _prep_spec(out.reshape(B * T, Hq * D).float(), PER=PER, GROUP=GROUP)


# One program a head. A program a quantization group (a GROUPS tunable, session 41) merged faster alone at 17 ranges
# on the H100 (5.57 us with 8 warps against 7.23 for this kernel's default, each with a ~3.5 us graph launch:
# bench/results/2026-12-07_h100_attention_merge_s41.csv) but lost 1.7% of llama-3.1-8b's decode at short contexts
# (455.1-457.6 tok/s against 462.8-464.8, 2026-12-07_h100_e2e_merge_groups_s41.csv) and, compiled by triton 3.6,
# fed the o projection wrong products at 8 rows, as two groups of 32 a program gave wrong values
# (bench/results/profiles/2026-12-07_h100_attention_gpu_tests_s41.log): removed. More warps a head at many ranges
# (6.18 us with 4) were not checked on a GPU before the session's device time ran out.
@kd.kernel(tune={"num_warps": kd.choice(1, 2, 4, default=2)},
           key=lambda part_acc, *_, **__: {"NS": part_acc.shape[0], "D": part_acc.shape[-1]}, spec=_merge_prep_spec,
           specialize=lambda part_acc, part_max, part_sum, q: {"BLOCK_S": max(pow2_at_least(part_acc.shape[0]),
                                                                              PREP_MIN_RANGES),
                                                               "HEAD_D": part_acc.shape[4]})
def attention_merge_prep(part_acc, part_max, part_sum, q, *, PER: kd.constexpr, GROUP: kd.constexpr,
                         BLOCK_S: kd.constexpr, HEAD_D: kd.constexpr):
    """attention_merge's output (rows b*T + t, columns h*D + d), rounded to q.dtype and written in
    qmv_h2's prepared form for the o projection: each program merges one head, whose D values are whole
    quantization groups (HEAD_D % GROUP == 0), so it also owns their planes, sums and scales."""
    from kilnx.kernels import qmv_h2 as H
    B, T, Hq, D = q.shape
    b, t, h, top, w, norm = _merge_weights(part_max, part_sum, B, T, Hq, BLOCK_S)
    DW = HEAD_D // PER                          # packed words of one head
    lo_i, hi_i = H.code_pairs_index(kd.arange(0, DW), PER)
    lo_i, hi_i = lo_i[None, :, :], hi_i[None, :, :]    # (1, DW, PER/2): broadcast over the ranges
    # the ranges' (DW, PER/2) tiles in (ranges, DW, PER/2) loads, MERGE_CHUNK ranges at a time: a loop
    # over single ranges waited for each range's loads in turn (17 round trips at a 2113-token cache:
    # 5.0 us per layer on the H200, as long as the attention itself); the chunk bounds the registers
    # at long contexts (64 ranges at 128k tokens)
    if BLOCK_S <= MERGE_CHUNK:
        s = kd.arange(0, BLOCK_S)[:, None, None]
        lo = kd.sum(kd.load(part_acc, s, b, t, h, lo_i) * w[:, None, None], axis=0)
        hi = kd.sum(kd.load(part_acc, s, b, t, h, hi_i) * w[:, None, None], axis=0)
    else:
        lo = kd.zeros((DW, PER // 2), kd.f32)
        hi = kd.zeros((DW, PER // 2), kd.f32)
        for s0 in kd.range(0, part_acc.shape[0], MERGE_CHUNK):
            s = s0 + kd.arange(0, MERGE_CHUNK)
            ws = kd.exp(kd.load(part_max, s, b, t, h, other=MASKED_MAX) - top)[:, None, None]
            lo += kd.sum(kd.load(part_acc, s[:, None, None], b, t, h, lo_i) * ws, axis=0)
            hi += kd.sum(kd.load(part_acc, s[:, None, None], b, t, h, hi_i) * ws, axis=0)
    y_lo = (lo * norm).astype(q.dtype).f32()
    y_hi = (hi * norm).astype(q.dtype).f32()
    return H.store_prepared(y_lo, y_hi, b * T + t, h * DW, h * DW + kd.arange(0, DW), B * T, Hq * HEAD_D,
                            PER=PER, GROUP=GROUP)


def attention_split(q, k_cache, v_cache, positions, kwargs: dict, *, config: dict | None = None, backend=None,
                    prepared: tuple[int, int] | None = None):
    """Decode attention over key ranges, merged: (B, T, Hq, D) in q.dtype (kwargs: _kernel_kwargs); with
    `prepared` = (PER, GROUP), the merge writes it as a PreparedX of (B*T, Hq*D) for qmatmul instead."""
    parts = attention_split_kernel(q, k_cache, v_cache, positions, config=config, backend=backend, **kwargs)
    return merge(parts, q, prepared, backend)


def context_view(k_cache, v_cache, kwargs: dict):
    """The caches cut at the parking limit (kwargs["limit"], the slot one past the context): no query sees a key
    there, so a split counts the context's key ranges, not the slot's (a 4096-token context in 4097 slots ran 17
    ranges of 256 keys and merged a 32-range tile). A parked row's new k, v then land nowhere: the fused decode
    kernel's only writer of a position is the program whose range holds it, and no range holds the slot."""
    limit = kwargs.get("limit", NO_LIMIT)
    if not 0 < limit < k_cache.shape[2]:
        return k_cache, v_cache
    return k_cache[:, :, :limit], v_cache[:, :, :limit]


def merges_prepared(head_dim: int, per: int, group: int) -> bool:
    """Whether attention_merge_prep writes a head of head_dim values in the prepared format (PER, GROUP): the head is
    whole groups and its packed words a power of two (a tile's length); else the plain merge and the prep (a 96-wide
    head in groups of 32 is 12 words, which the prepared merge's tile cannot hold)."""
    words = head_dim // per
    return head_dim % group == 0 and words & (words - 1) == 0


def merge(parts, q, prepared, backend=None):
    """The ranges' partial results merged: (B, T, Hq, D) in q.dtype, or with `prepared` a PreparedX."""
    from kilnx.kernels.prepared import PreparedX, prepare
    if prepared is not None and merges_prepared(q.shape[3], *prepared):
        planes, sums, xs = attention_merge_prep(*parts, q, PER=prepared[0], GROUP=prepared[1], backend=backend)
        return PreparedX(planes, sums, xs, q.dtype)
    out = attention_merge(*parts, q, backend=backend)
    return out if prepared is None else prepare(out.reshape(-1, out.shape[2] * out.shape[3]), prepared)


def use_split(q, k_cache) -> bool:
    """On the GPU, a decode step (the query heads of a row's tokens fit one tile) with fewer (batch
    row, KV head) programs than SMs and a cache long enough to split. KILNX_ATTENTION_SPLIT=0 turns
    it off (for comparisons)."""
    B, T, Hq, _ = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    if not q.is_cuda or T * (Hq // Hk) > 16 or S < 128 or os.environ.get("KILNX_ATTENTION_SPLIT") == "0":
        return False
    return B * Hk < _sm_count(q.device)


# The merge a decode step runs after the split where the o projection takes prepared x (a 4- or 8-bit model at one
# row): the prepared merge, which reads the ranges MERGE_CHUNK at a time. Timing the plain merge instead misled: on
# the H100 a tune picked 32 keys per range at 2048 slots (13.1 us with the plain merge against the default's 14.5) and
# llama-3.1-8b then decoded 390.1 / 390.9 tok/s against 417.9 / 416.0 untuned (67 ranges: three dependent chunk
# loads in the prepared merge, where the default's 17 take one): 2026-12-07_h100_e2e_attention_tuned_plain_s40.csv.
TUNING_PREPARED = (8, 64)


def _merged(parts, q, k_cache, v_cache, positions):
    return merge(parts, q, TUNING_PREPARED)


def _merged_values(prepared, q, *_):
    from kilnx.kernels.qmv_h2 import _x_of
    return _x_of(prepared.planes, prepared.xs).to(q.dtype).view(q.shape)


def _merged_formula(q, k_cache, v_cache, positions):
    return attention_formula(q, k_cache, v_cache, positions, q.shape[3] ** -0.5)


# Tuned as the split and its merge: the partial results depend on KEYS_PER_SPLIT, a tunable, so no one spec checks
# every config (checked alone, every trial but the default's failed the gate), while the merged output is the
# attention formula's whatever the ranges; and the merge's time grows with the ranges a config makes. Checked on the
# prepared merge's values (finished_values), timed as the step runs it. Decode at llama-3.1-8b's heads, one row, at the
# caches `kilnx bench` decodes on (a 128-token prompt: 256 slots; 2048: 2113, bucketed as 2048).
attention_split_kernel.exact_buckets = True
attention_split_kernel.tuning(
    make_args=_attn_problem_args, finish=_merged, finished_reference=_merged_formula, finished_values=_merged_values,
    problems=[{"B": 1, "T": 1, "Hq": 32, "Hk": 8, "D": 128, "S": S, "ctx": S, "dtype": "bf16"} for S in (256, 2048)])
