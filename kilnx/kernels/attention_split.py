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

import os

import torch

import kilnx.dsl as kd
from kilnx.kernels.attention import (MASKED_MAX, NO_WINDOW, _attn_key, _attn_problem_args, _next_pow2, attend,
                                     query_tile, visible_keys)


def _split_spec(q, k_cache, v_cache, positions, *, scale, cap=0.0, window=NO_WINDOW, SOFTCAP=False,
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
    pos = positions.to(q.device)[:, :, None, None]
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
    return {"BLOCK_M": max(16, _next_pow2(q.shape[1] * q.shape[2] // k_cache.shape[1])), "BLOCK_N": 64,
            "KEYS_PER_SPLIT": keys_per_split(q, k_cache), "num_warps": 4, "num_stages": 3}


def keys_per_split(q, k_cache, *, programs: int | None = None) -> int:
    """A power of two (>= 128) of keys per range so that the (batch row, KV head, range) programs
    number about twice the SMs, or `programs`."""
    B, Hk, S = q.shape[0], k_cache.shape[1], k_cache.shape[2]
    if programs is None:
        programs = 2 * (_sm_count(q.device) if q.is_cuda else 8)
    want = max(S * B * Hk // programs, 1)
    return min(max(128, 1 << (want.bit_length() - 1)), 8192)


_SMS: dict = {}


def _sm_count(device) -> int:
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


@kd.kernel(
    tune={"BLOCK_M": kd.pow2(16, 64, default=16), "BLOCK_N": kd.pow2(16, 128, default=64),
          "KEYS_PER_SPLIT": kd.pow2(16, 8192, default=512),
          "num_warps": kd.choice(2, 4, 8, default=4), "num_stages": kd.choice(1, 2, 3, 4, default=3)},
    constraints=[lambda KEYS_PER_SPLIT, BLOCK_N: KEYS_PER_SPLIT >= BLOCK_N],
    key=_attn_key, default=_split_default, spec=_split_spec,
    specialize=lambda q, k_cache, v_cache, positions: {"BLOCK_D": max(_next_pow2(q.shape[3]), 16),
                                                       "scale": q.shape[3] ** -0.5})
def attention_split_kernel(q, k_cache, v_cache, positions, *, scale: float, cap: float = 0.0, window: int = NO_WINDOW,
                           BLOCK_D: kd.constexpr = 64, SOFTCAP: kd.constexpr = False, BLOCK_M, BLOCK_N,
                           KEYS_PER_SPLIT):
    B, T, Hq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hk
    NS = kd.cdiv(S, KEYS_PER_SPLIT)
    pid_m, pid_bh, split = kd.grid(kd.cdiv(T * group, BLOCK_M), B * Hk, NS)
    b = pid_bh // Hk
    kv_head = pid_bh % Hk
    q_tile, token, head, row_valid, d = query_tile(q, pid_m, kv_head, b, group, T, BLOCK_M, BLOCK_D)
    pos = kd.load(positions, b, token, other=-1)
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
           specialize=lambda part_acc, part_max, part_sum, q: {"BLOCK_S": _next_pow2(part_acc.shape[0]),
                                                               "BLOCK_D": max(_next_pow2(part_acc.shape[4]), 16)})
def attention_merge(part_acc, part_max, part_sum, q, *, BLOCK_S: kd.constexpr, BLOCK_D: kd.constexpr):
    """out[b, t, h] = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s), in q.dtype."""
    NS, B, T, Hq, D = part_acc.shape
    r = kd.grid(B * T * Hq)
    b, t, h = r // (T * Hq), (r // Hq) % T, r % Hq
    s = kd.arange(0, BLOCK_S)
    d = kd.arange(0, BLOCK_D)
    m = kd.load(part_max, s, b, t, h, other=MASKED_MAX)
    w = kd.exp(m - kd.max(m))
    total = kd.sum(w * kd.load(part_sum, s, b, t, h))
    acc = kd.sum(kd.load(part_acc, s[:, None], b, t, h, d[None, :]) * w[:, None], axis=0)
    out = kd.output((B, T, Hq, D), q.dtype)
    kd.store(out, b, t, h, d, acc / kd.where(total > 0, total, 1.0))
    return out


def attention_split(q, k_cache, v_cache, positions, kwargs: dict, *, config: dict | None = None, backend=None):
    """Decode attention over key ranges, merged: (B, T, Hq, D) in q.dtype (kwargs: _kernel_kwargs)."""
    parts = attention_split_kernel(q, k_cache, v_cache, positions, config=config, backend=backend, **kwargs)
    return attention_merge(*parts, q, backend=backend)


def use_split(q, k_cache) -> bool:
    """On the GPU, a decode step (the query heads of a row's tokens fit one tile) with fewer (batch
    row, KV head) programs than SMs and a cache long enough to split. KILNX_ATTENTION_SPLIT=0 turns
    it off (for comparisons)."""
    B, T, Hq, _ = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    if not q.is_cuda or T * (Hq // Hk) > 16 or S < 512 or os.environ.get("KILNX_ATTENTION_SPLIT") == "0":
        return False
    return B * Hk < _sm_count(q.device)


attention_split_kernel.tuning(
    make_args=_attn_problem_args,
    problems=[{"B": B, "T": 1, "Hq": 32, "Hk": 8, "D": 128, "S": 4096, "ctx": ctx, "dtype": "bf16"}
              for B, ctx in ((1, 2000), (1, 200), (4, 2000))])
