"""Decode attention fed by the step's own q, k and v: the rotary embedding and the KV-cache write fused in.

A decode step otherwise runs rope_cache_kernel (rotate q in place, write rotated k and v into the
caches) and then attention: two launches per layer for a few hundred bytes of new data. Here the
attention kernel takes q (B, 1, Hq, D) and k, v (B, Hk, D) where the qkv projection left them, rotates
q and k as it loads them, writes k and v into the caches itself, and after a block barrier attends
over the cache as written (substituting the new key in every key tile instead took 4.7 ms of a CPU
SmolLM2 step against 4.5 ms for rope_cache and attention together). Two variants: one program per (row, KV head) over all keys (`attention_new_kv_kernel`), and
the flash-decoding split over key ranges (`attention_split_new_kv_kernel`, merged by
attention_split.merge), where only the range holding the new position writes the cache.
"""

from __future__ import annotations

import os

import torch

import kilnx.dsl as kd
from kilnx.kernels import attention_split as AS
from kilnx.kernels.attention import (NO_WINDOW, TUNE, _attn_default, _attn_key, _kernel_kwargs, attend_all, attention,
                                     attention_formula, parked, query_rows)
from kilnx.kernels.rope import _rope_cache_spec, rotated_tile
from kilnx.kernels.sizes import NO_LIMIT, pow2_at_least


def enabled(device_type: str, split: bool) -> bool:
    """KILNX_FUSED_ROPE=1/0 decides; by default on where it was measured faster: the CPU (numba) and the
    GPU's one-program variant (llama-3.2-1b on the H200: 1381 / 1270 tok/s against 1254 / 1228 without,
    2026-12-03_h200_e2e_s7_fused_rope_*.csv), not the GPU's split variant (llama-3.1-8b with a cache
    of 2113: 401 / 381 against 421 / 392)."""
    env = os.environ.get("KILNX_FUSED_ROPE")
    if env in ("0", "1"):
        return env == "1"
    return device_type == "cpu" or not split


def _with_new_kv(q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache, interleaved):
    """(q rotated (B, 1, Hq, D), the caches with the new k, v written): rope_cache_kernel's meaning."""
    qr, kc, vc = _rope_cache_spec(q[:, 0], k_new, v_new, positions[:, 0], rows, inv_freq, k_cache, v_cache,
                                  INTERLEAVED=interleaved)
    return qr[:, None], kc, vc


def _new_token_tiles(q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache, pid_m, b, kv_head, group,
                     keys=None, *, BLOCK_M: int, BLOCK_D: int, INTERLEAVED: bool):
    """The program's rotated query tile, after writing the new key and value of (b, kv_head) into the
    caches (only if the new position lies in `keys` = (first, count) when given) and a barrier, so that
    the program's reads of the cache see them. Returns (q_tile, token, head, d, pos)."""
    token, head = query_rows(pid_m, kv_head, group, BLOCK_M)
    d = kd.arange(0, BLOCK_D)
    pos = kd.load(positions, b, token, other=-1)
    q_tile = rotated_tile(q, b, token[:, None], head[:, None], d=d[None, :], pos=pos[:, None], inv_freq=inv_freq,
                          interleaved=INTERLEAVED).astype(q.dtype)
    new_pos = kd.load(positions, b, 0, check=(True, False))   # a literal index: no bounds check
    owner = None if keys is None else (new_pos >= keys[0]) & (new_pos < keys[0] + keys[1])
    k_row = rotated_tile(k_new, b, kv_head, d=d, pos=new_pos, inv_freq=inv_freq, interleaved=INTERLEAVED)
    row = kd.load(rows, b)
    kd.store(k_cache, row, kv_head, new_pos, d, k_row, mask=owner)
    kd.store(v_cache, row, kv_head, new_pos, d, kd.load(v_new, b, kv_head, d), mask=owner)
    kd.barrier()
    return q_tile, token, head, d, pos


# ---- one program per (row, KV head) ------------------------------------------------------------------
def _spec(q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache, *, scale, cap=0.0, window=NO_WINDOW,
          limit=NO_LIMIT, SOFTCAP=False, INTERLEAVED=False, **_):
    qr, kc, vc = _with_new_kv(q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache, INTERLEAVED)
    return attention_formula(qr, kc, vc, positions, scale, softcap=cap if SOFTCAP else None,
                             window=None if window >= NO_WINDOW else window, limit=limit)


def _args_key(q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache, **_):
    return _attn_key(q, k_cache, v_cache, positions)


def _specialize(q, *_):
    return {"BLOCK_D": max(pow2_at_least(q.shape[3]), 16), "scale": q.shape[3] ** -0.5}


@kd.kernel(tune=TUNE, key=_args_key, spec=_spec, specialize=_specialize,
           default=lambda q, kn, vn, positions, rows, inv, k_cache, v_cache, **_: _attn_default(q, k_cache, v_cache,
                                                                                                positions))
def attention_new_kv_kernel(q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache, *, scale: float,
                            cap: float = 0.0, window: int = NO_WINDOW, limit: int = NO_LIMIT,
                            BLOCK_D: kd.constexpr = 64, SOFTCAP: kd.constexpr = False,
                            INTERLEAVED: kd.constexpr = False, BLOCK_M, BLOCK_N):
    """attention_kernel for one new token per row, from the projection's q, k, v (see the module doc)."""
    B, T, Hq, D = q.shape
    Hk = k_cache.shape[1]
    pid_m, pid_bh = kd.grid(kd.cdiv(T * (Hq // Hk), BLOCK_M), B * Hk)
    b, kv_head = pid_bh // Hk, pid_bh % Hk
    q_tile, token, head, d, pos = _new_token_tiles(q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache,
                                                   pid_m, b, kv_head, Hq // Hk, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
                                                   INTERLEAVED=INTERLEAVED)
    return attend_all(q_tile, token, head, d, parked(pos, limit), q, k_cache, v_cache, b, kv_head, scale=scale,
                      cap=cap, window=window, SOFTCAP=SOFTCAP, BLOCK_N=BLOCK_N)


# ---- split over key ranges ----------------------------------------------------------------------------
def _split_spec(q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache, *, INTERLEAVED=False, **kw):
    qr, kc, vc = _with_new_kv(q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache, INTERLEAVED)
    return AS._split_spec(qr, kc, vc, positions, **kw)


@kd.kernel(tune=AS.TUNE, constraints=AS.CONSTRAINTS, key=_args_key, spec=_split_spec, specialize=_specialize,
           default=lambda q, kn, vn, positions, rows, inv, k_cache, v_cache, **_: AS._split_default(q, k_cache, v_cache,
                                                                                                    positions))
def attention_split_new_kv_kernel(q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache, *, scale: float,
                                  cap: float = 0.0, window: int = NO_WINDOW, limit: int = NO_LIMIT,
                                  BLOCK_D: kd.constexpr = 64, SOFTCAP: kd.constexpr = False,
                                  INTERLEAVED: kd.constexpr = False, BLOCK_M, BLOCK_N, KEYS_PER_SPLIT):
    """attention_split_kernel for one new token per row, from the projection's q, k, v: only the program
    whose key range holds the new position writes the caches (no other program reads that position)."""
    B, T, Hq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    pid_m, pid_bh, split = kd.grid(kd.cdiv(T * (Hq // Hk), BLOCK_M), B * Hk, kd.cdiv(S, KEYS_PER_SPLIT))
    b, kv_head = pid_bh // Hk, pid_bh % Hk
    q_tile, token, head, d, pos = _new_token_tiles(q, k_new, v_new, positions, rows, inv_freq, k_cache, v_cache,
                                                   pid_m, b, kv_head, Hq // Hk, (split * KEYS_PER_SPLIT, KEYS_PER_SPLIT),
                                                   BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, INTERLEAVED=INTERLEAVED)
    return AS._attend_range(q_tile, token, head, token < T, d, parked(pos, limit), k_cache, v_cache, b, kv_head,
                            split, B, T, Hq, D, scale=scale, cap=cap, window=window, SOFTCAP=SOFTCAP, BLOCK_N=BLOCK_N,
                            KEYS_PER_SPLIT=KEYS_PER_SPLIT)


def attention_new_tokens(q, k, v, positions, rows, inv_freq, k_cache, v_cache, scale, *, softcap=None, window=None,
                         limit=None, interleaved=False, prepared=None):
    """kilnx.ops.attention_new_tokens: rope_and_cache_ then attention, for q (B*T, Hq, D) and k, v (B*T, Hk, D)
    as the projection left them; one launch fewer for a decode step (one token per row) where `enabled`."""
    from kilnx.kernels import rope
    B, T = positions.shape
    q4 = q.view(B, T, q.shape[1], q.shape[2])
    split = T == 1 and AS.use_split(q4, k_cache)
    if T == 1 and enabled(q.device.type, split):
        kw = _kernel_kwargs(q4, k_cache, scale, softcap, window, limit)
        args = (q4, k.view(B, k.shape[1], k.shape[2]), v.view(B, v.shape[1], v.shape[2]), positions, rows, inv_freq,
                k_cache, v_cache)
        if split:
            args = (*args[:6], *AS.context_view(k_cache, v_cache, kw))
            return AS.merge(attention_split_new_kv_kernel(*args, INTERLEAVED=bool(interleaved), **kw), q4, prepared)
        out = attention_new_kv_kernel(*args, INTERLEAVED=bool(interleaved), **kw)
        if prepared is None:
            return out
        from kilnx.kernels.prepared import prepare
        return prepare(out.reshape(B, -1), prepared)
    rope.rope_and_cache_(q, k, v, positions.reshape(-1), rows, inv_freq, k_cache, v_cache, interleaved=interleaved)
    return attention(q4, k_cache, v_cache, positions, scale, softcap=softcap, window=window, limit=limit,
                     prepared=prepared)


def _problem_args(problem: dict, device: str):
    """attention's decode problem {B, T=1, Hq, Hk, D, S, ctx, dtype} with the new token's k and v, cache rows
    and llama-3's rotary frequencies."""
    from kilnx.kernels.attention import _attn_problem_args
    q, k_cache, v_cache, positions = _attn_problem_args(problem, device)
    B, Hk, D = q.shape[0], k_cache.shape[1], q.shape[3]
    k_new = torch.randn(B, Hk, D).to(q.dtype).to(device)
    v_new = torch.randn(B, Hk, D).to(q.dtype).to(device)
    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))).to(device)
    return q, k_new, v_new, positions, torch.arange(B, device=device), inv_freq, k_cache, v_cache


_DECODE_PROBLEMS = [{"B": B, "T": 1, "Hq": 32, "Hk": 8, "D": 128, "S": S, "ctx": ctx, "dtype": "bf16"}
                    for B, S, ctx in ((1, 256, 200), (1, 4096, 2000), (4, 4096, 2000))]
attention_new_kv_kernel.tuning(make_args=_problem_args, problems=_DECODE_PROBLEMS)
# (the split variant's partial results depend on KEYS_PER_SPLIT, a tunable: no one reference checks them)
