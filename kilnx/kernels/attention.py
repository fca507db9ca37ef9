"""Causal attention of new queries over a KV cache: one flash-attention style DSL tile kernel.

Layout of the work. The group = Hq / Hk query heads that share a KV head are packed together with
their tokens into the rows of one query tile, so each program streams the K/V tiles of its KV head
once for the whole group. That is what makes decode (T = 1) efficient: with llama-3's group of 4, a
16-row tile holds the 4 heads of one token (the other rows are masked) and both products still run
on tensor cores, where a per-head program would do a 1-row GEMV per head and read each K/V tile 4
times.

Per program (pid_m, b * Hk + kv_head): row r is pair = pid_m * BLOCK_M + r of the (token, head in
group) pairs, head fastest: token = pair // group, head = kv_head * group + pair % group. Dense, so
odd group sizes (7, 3) waste no rows. Keys are visited in blocks of BLOCK_N from the window start of
the earliest query in the tile to the largest position in it + 1; both bounds are read from
`positions` inside the kernel, so the same compiled kernel serves every step of a CUDA-graph replay.
Online softmax in fp32: a running row max, a running sum and an fp32 accumulator, rescaled by
exp(old max - new max) whenever the max grows.

A query at `limit` or past it is parked (runtime/kv_cache.py's parking slot: a row riding along in a batched step
without a token, a prompt's padding): it attends to nothing and its output is 0. Its position does not widen the
tile's key range, which it did when parking was only a position: a parked row walked the whole cache in every
attention layer of every step.
"""

from __future__ import annotations

import math
import os

import torch

import kilnx.dsl as kd
from kilnx.kernels._tuning import DTYPES
from kilnx.kernels.sizes import NO_LIMIT, pow2_at_least

NO_WINDOW = 1 << 40   # a window wider than any cache: every key up to the query's position is seen
MASKED_MAX = -1e30     # running max before any key: finite, so exp(m_old - m_new) is never nan


def _attn_key(q, k_cache, v_cache, positions, **_):
    B, T, Hq, D = q.shape
    return {"B": B, "T": T, "Hq": Hq, "Hk": k_cache.shape[1], "D": D}


def _attn_default(q, k_cache, v_cache, positions, **_):
    # picked from a sweep on an H200 (llama-3.1-8b heads, bf16, 2k context); the tuner refines them
    B, T, Hq, D = q.shape
    Hk = k_cache.shape[1]
    if q.device.type == "cpu" and T * (Hq // Hk) <= 16:
        # numba computes every row of the tile: just the rows a decode step has, and short K/V tiles
        # (SmolLM2's 3 query heads per KV head: 45-103 us against 79-197 us for 16 x 64, 2 cores)
        return {"BLOCK_M": max(4, pow2_at_least(T * (Hq // Hk))), "BLOCK_N": 32}
    if T * (Hq // Hk) <= 16:   # decode: the query heads of a token (or a few tokens) fill 16 rows
        if B * Hk < 132:       # fewer programs than SMs: long K/V tiles and deep pipelining per program
            return {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
        return {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def attention_formula(q, k_cache, v_cache, positions, scale, softcap=None, window=None, limit=None):
    """The meaning of the kernel in float64 eager torch: (B, T, Hq, D) in q.dtype. A query at `limit` or past it
    (parked) sees no key: its output is 0."""
    B, T, Hq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hk
    k = k_cache.double().repeat_interleave(group, dim=1)                # (B, Hq, S, D)
    v = v_cache.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("bthd,bhsd->bhts", q.double(), k) * scale      # (B, Hq, T, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    j = torch.arange(S, device=q.device)
    pos = parked_formula(positions.to(q.device), limit)[:, None, :, None]   # (B, 1, T, 1)
    visible = j <= pos
    if window is not None:
        visible = visible & (j > pos - window)
    probs = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1)
    probs = torch.where(visible.any(-1, keepdim=True), probs, 0.0)      # a parked row: 0, not 0/0
    return torch.einsum("bhts,bhsd->bthd", probs, v).to(q.dtype)


def parked_formula(positions, limit):
    """Positions with the parked ones (at `limit` or past it) as -1, which sees no key."""
    return positions if limit is None or limit >= NO_LIMIT else torch.where(positions < limit, positions, -1)


def _attn_spec(q, k_cache, v_cache, positions, *, scale, cap=0.0, window=NO_WINDOW, limit=NO_LIMIT, SOFTCAP=False,
               **_):
    return attention_formula(q, k_cache, v_cache, positions, scale, softcap=cap if SOFTCAP else None,
                             window=None if window >= NO_WINDOW else window, limit=limit)


def _shape_derived_kwargs(q, k_cache, v_cache, positions) -> dict:
    """Compile-time head-dim tile (a power of two >= D) and the usual scale, so that the tuner can
    compile and check the kernel from its tensors alone; a caller's own keywords win."""
    return {"BLOCK_D": max(pow2_at_least(q.shape[3]), 16), "scale": q.shape[3] ** -0.5}


def query_rows(pid_m, kv_head, group, BLOCK_M: int):
    """(token, head) of the query tile's rows: (token, head in group) pairs, head fastest, densely (no
    padding for odd group sizes)."""
    pair = pid_m * BLOCK_M + kd.arange(0, BLOCK_M)
    return pair // group, kv_head * group + pair % group


def query_tile(q, pid_m, kv_head, b, group, T, BLOCK_M: int, BLOCK_D: int):
    """(q_tile (BLOCK_M, BLOCK_D), token, head, row_valid, d) of the rows `query_rows` gives."""
    token, head = query_rows(pid_m, kv_head, group, BLOCK_M)
    d = kd.arange(0, BLOCK_D)
    return kd.load(q, b, token[:, None], head[:, None], d[None, :]), token, head, token < T, d


def parked(pos, limit):
    """The rows' positions with the parked ones (at `limit` or past it) as -1: they see no key and do not widen
    the tile's key range."""
    return kd.where(pos < limit, pos, -1)


def visible_keys(pos, row_valid, S, window, BLOCK_N: int):
    """[start, stop) of the keys any row of the tile can see: from the earliest window start (aligned
    down to BLOCK_N, for aligned K/V tile loads) to the latest position + 1. Rows at -1 (padding, parked)
    see none; a tile of only those walks no key."""
    key_stop = kd.minimum(kd.max(pos) + 1, S)
    earliest = kd.min(kd.where(row_valid & (pos >= 0), pos, S))
    return kd.maximum(earliest - window + 1, 0) // BLOCK_N * BLOCK_N, key_stop


def attend(q_tile, pos, k_cache, v_cache, b, kv_head, d, key_start, key_stop, key_limit, *, scale, cap, window,
           SOFTCAP: bool, BLOCK_N: int):
    """Online softmax over keys [key_start, key_stop) (keys at or past key_limit are masked): the
    unnormalized fp32 accumulator, the running row max and the running row sum."""
    BLOCK_M = q_tile.shape[0]
    # the products' operand dtype: the queries', or fp16 for 16-bit queries over an fp8 cache, whose codes widen
    # to fp16 pairs in one conversion on sm_90 where bf16 takes a detour through fp32 (and fp16 holds e4m3 and
    # a bf16 query's value more finely, up to fp16's range of 65504)
    mma = kd.f16 if k_cache.dtype == kd.f8e4 and q_tile.dtype in (kd.bf16, kd.f16) else q_tile.dtype
    q_tile = q_tile.to(mma)
    row_max = kd.var(kd.full((BLOCK_M,), MASKED_MAX, kd.f32))
    row_sum = kd.zeros((BLOCK_M,), kd.f32)
    acc = kd.zeros((BLOCK_M, d.shape[0]), kd.f32)
    for n0 in kd.range(key_start, key_stop, BLOCK_N):
        key = n0 + kd.arange(0, BLOCK_N)
        # (BLOCK_D, BLOCK_N) = K^T, widened to the products' dtype where the cache is narrower (fp8)
        k_tile_t = kd.load(k_cache, b, kv_head, key[None, :], d[:, None]).to(mma)
        scores = kd.dot(q_tile, k_tile_t) * scale
        if SOFTCAP:
            scores = cap * kd.tanh(scores / cap)
        visible = ((key[None, :] <= pos[:, None]) & (key[None, :] > pos[:, None] - window)
                   & (key[None, :] < key_limit))
        scores = kd.where(visible, scores, float("-inf"))
        new_max = kd.maximum(row_max, kd.max(scores, axis=1))
        rescale = kd.exp(row_max - new_max)
        p = kd.exp(scores - new_max[:, None])
        row_sum.set(row_sum * rescale + kd.sum(p, axis=1))
        v_tile = kd.load(v_cache, b, kv_head, key[:, None], d[None, :]).to(mma)
        # p in the products' dtype so the second product runs on tensor cores like the first
        acc.set(acc * rescale[:, None] + kd.dot(p.to(mma), v_tile))
        row_max.set(new_max)
    return acc, row_max, row_sum


def attend_all(q_tile, token, head, d, pos, q, k_cache, v_cache, b, kv_head, *, scale, cap, window, SOFTCAP,
               BLOCK_N: int):
    """Every key the tile's rows can see, normalized: the (B, T, Hq, D) output in q.dtype."""
    B, T, Hq, D = q.shape
    S = k_cache.shape[2]
    key_start, key_stop = visible_keys(pos, token < T, S, window, BLOCK_N)
    acc, row_max, row_sum = attend(q_tile, pos, k_cache, v_cache, b, kv_head, d, key_start, key_stop, S,
                                   scale=scale, cap=cap, window=window, SOFTCAP=SOFTCAP, BLOCK_N=BLOCK_N)
    out = kd.output((B, T, Hq, D), q.dtype)
    seen_any = kd.where(row_sum > 0, row_sum, 1.0)   # padding rows saw no key: 0, not 0/0
    kd.store(out, b, token[:, None], head[:, None], d[None, :], acc / seen_any[:, None])
    return out


TUNE = {"BLOCK_M": kd.pow2(4, 128, default=16), "BLOCK_N": kd.pow2(16, 256, default=64),
        "num_warps": kd.choice(2, 4, 8, default=4), "num_stages": kd.choice(1, 2, 3, 4, default=2)}


@kd.kernel(tune=TUNE, key=_attn_key, default=_attn_default, spec=_attn_spec, specialize=_shape_derived_kwargs)
def attention_kernel(q, k_cache, v_cache, positions, *, scale: float, cap: float = 0.0, window: int = NO_WINDOW,
                     limit: int = NO_LIMIT, BLOCK_D: kd.constexpr = 64, SOFTCAP: kd.constexpr = False, BLOCK_M,
                     BLOCK_N):
    B, T, Hq, D = q.shape
    group = Hq // k_cache.shape[1]
    pid_m, pid_bh = kd.grid(kd.cdiv(T * group, BLOCK_M), B * k_cache.shape[1])
    b = pid_bh // k_cache.shape[1]
    kv_head = pid_bh % k_cache.shape[1]
    q_tile, token, head, _, d = query_tile(q, pid_m, kv_head, b, group, T, BLOCK_M, BLOCK_D)
    pos = parked(kd.load(positions, b, token, other=-1), limit)
    return attend_all(q_tile, token, head, d, pos, q, k_cache, v_cache, b, kv_head, scale=scale, cap=cap,
                      window=window, SOFTCAP=SOFTCAP, BLOCK_N=BLOCK_N)


def _kernel_kwargs(q, k_cache, scale, softcap, window, limit=None) -> dict:
    if q.shape[2] % k_cache.shape[1]:
        raise ValueError(f"attention: {q.shape[2]} query heads is not a multiple of {k_cache.shape[1]} KV heads")
    if window is not None and window < 1:
        raise ValueError(f"attention: window must be >= 1, got {window}")
    if limit is not None and not 0 <= limit < NO_LIMIT:
        raise ValueError(f"attention: the parking limit must lie in [0, {NO_LIMIT}), got {limit}")
    if os.environ.get("KILNX_PARKED_ATTENTION") == "walk":   # for comparisons: parked rows attend as before
        limit = None
    return dict(scale=float(scale), cap=float(softcap or 0.0), window=int(window) if window is not None else NO_WINDOW,
                limit=int(limit) if limit is not None else NO_LIMIT, SOFTCAP=softcap is not None)


def attention(q, k_cache, v_cache, positions, scale, *, softcap=None, window=None, limit=None, prepared=None):
    """kilnx.ops.attention: q (B, T, Hq, D) over caches (B, Hk, S, D) -> (B, T, Hq, D) in q.dtype; queries at
    `limit` or past it are parked (output 0, no keys read). A GPU
    decode step with fewer (row, KV head) pairs than SMs splits the keys (attention_split.py). With
    `prepared` = (PER, GROUP) from prepared_format, the result comes as a PreparedX of (B*T, Hq*D)."""
    from kilnx.kernels import attention_split
    kw = _kernel_kwargs(q, k_cache, scale, softcap, window, limit)
    if attention_split.use_split(q, k_cache):
        return attention_split.attention_split(q, *attention_split.context_view(k_cache, v_cache, kw), positions, kw,
                                               prepared=prepared)
    out = attention_kernel(q, k_cache, v_cache, positions, **kw)
    if prepared is None:
        return out
    from kilnx.kernels.prepared import prepare
    return prepare(out.reshape(-1, out.shape[2] * out.shape[3]), prepared)


def _attn_problem_args(problem: dict, device: str):
    """{B, T, Hq, Hk, D, S, dtype} -> (q, k_cache, v_cache, positions); the T new tokens sit at the end
    of a context of `ctx` tokens (default: filling the cache)."""
    dt = DTYPES[problem.get("dtype", "bf16")]
    # the global generator: the tuner seeds it per draw, so gate inputs differ from timing inputs
    B, T, Hq, Hk, D, S = (problem[n] for n in ("B", "T", "Hq", "Hk", "D", "S"))
    ctx = problem.get("ctx", S)
    q = torch.randn(B, T, Hq, D).to(dt).to(device)
    k_cache = torch.randn(B, Hk, S, D).to(dt).to(device)
    v_cache = torch.randn(B, Hk, S, D).to(dt).to(device)
    positions = (ctx - T + torch.arange(T))[None, :].expand(B, T).contiguous().to(device)
    return q, k_cache, v_cache, positions


attention_kernel.tuning(
    make_args=_attn_problem_args,
    problems=[{"B": B, "T": 1, "Hq": 32, "Hk": 8, "D": 128, "S": 2048, "ctx": 2000, "dtype": "bf16"}
              for B in (1, 8, 32)]
    + [{"B": 1, "T": T, "Hq": 32, "Hk": 8, "D": 128, "S": 2048, "ctx": T, "dtype": "bf16"} for T in (512, 2048)]
    + [{"B": 1, "T": 1, "Hq": 8, "Hk": 1, "D": 256, "S": 4096, "ctx": 4000, "dtype": "bf16"}])
