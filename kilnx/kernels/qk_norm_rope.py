"""Per-head RMSNorm of q and k (qwen3, gemma3), the rotary embedding and the KV-cache write in one launch.

Why: a qwen3 layer ran `rms_norm(q)`, `rms_norm(k)` and then rope + cache write (or the attention that
rotates as it loads): two launches per layer of a few microseconds each for a few kilobytes, 96 of a
qwen3-30b-a3b decode step. With full rotary width a rotary pair block holding every pair of a head
holds the whole head, so the norm's sum of squares is there for the taking before the rotation.

Values are those of the two-step path: each head is normalized in fp32 and rounded to the activation
dtype (what rms_norm stored), then rotated in fp32 and rounded again.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd
from kilnx.kernels.rope import (InPlaceAsOutputs, _next_pow2, _rope_cache_problem_args, _rope_cache_spec,
                                _rotation)


def _norm_spec(x, w, eps, offset):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.float())).to(x.dtype)


def _spec(q, k, v, q_norm, k_norm, positions, rows, inv_freq, k_cache, v_cache, *, eps, offset=0.0,
          INTERLEAVED=False, **_):
    """q normalized per head and rotated; the caches with k normalized and rotated and v written at
    [rows[t], :, positions[t], :]."""
    return _rope_cache_spec(_norm_spec(q, q_norm, eps, offset), _norm_spec(k, k_norm, eps, offset), v, positions,
                            rows, inv_freq, k_cache, v_cache, INTERLEAVED=INTERLEAVED)


def _key(q, k, v, q_norm, k_norm, positions, *_, **__):
    return {"T": q.shape[0], "Hq": q.shape[1], "Hk": k.shape[1], "D": q.shape[2]}


def _default(q, k, *_, **__):
    return {"BLOCK_H": min(_next_pow2(max(q.shape[1], k.shape[1])), 16)}


@InPlaceAsOutputs.of(mutated=(0, 8, 9))
@kd.kernel(tune={"BLOCK_H": kd.pow2(1, 64, default=8), "num_warps": kd.choice(1, 2, 4, 8, default=2)},
           key=_key, default=_default, spec=_spec,
           specialize=lambda q, k, v, qn, kn, positions, rows, inv_freq, kc, vc: {
               "HALF": _next_pow2(inv_freq.shape[0]), "BLOCK_D": _next_pow2(q.shape[2])})
def qk_norm_rope_cache_kernel(q, k, v, q_norm, k_norm, positions, rows, inv_freq, k_cache, v_cache, *, eps: float,
                              offset: float = 0.0, INTERLEAVED: kd.constexpr = False, HALF: kd.constexpr,
                              BLOCK_D: kd.constexpr, BLOCK_H):
    """One program per token: every head of q normalized and rotated in place, every head of k normalized,
    rotated and written to k_cache, v copied to v_cache. Full rotary width only (2 * len(inv_freq) = D)."""
    T, D = q.shape[0], q.shape[2]
    t = kd.grid(T)
    pos = kd.load(positions, t)
    row = kd.load(rows, t)
    in_rot, cos, sin, dim_a, dim_b = _rotation(pos.f32(), inv_freq, 0, HALF, INTERLEAVED)   # every pair
    for x, w, dest in ((q, q_norm, lambda head: (q, t, head)), (k, k_norm, lambda head: (k_cache, row, head, pos))):
        w_a = offset + kd.load(w, dim_a, mask=in_rot).f32()
        w_b = offset + kd.load(w, dim_b, mask=in_rot).f32()
        for h0 in kd.range(0, x.shape[1], BLOCK_H):
            head = (h0 + kd.arange(0, BLOCK_H))[:, None]
            a = kd.load(x, t, head, dim_a, mask=in_rot).f32()
            b = kd.load(x, t, head, dim_b, mask=in_rot).f32()
            inv = kd.rsqrt((kd.sum(a * a, axis=1) + kd.sum(b * b, axis=1)) / D + eps)[:, None]
            # rounded as rms_norm's output was, before the rotation reads it
            a = (a * inv * w_a).astype(x.dtype).f32()
            b = (b * inv * w_b).astype(x.dtype).f32()
            kd.store(*dest(head), dim_a, a * cos - b * sin, mask=in_rot)
            kd.store(*dest(head), dim_b, b * cos + a * sin, mask=in_rot)
    dim = kd.arange(0, BLOCK_D)[None, :]
    for h0 in kd.range(0, v.shape[1], BLOCK_H):
        head = (h0 + kd.arange(0, BLOCK_H))[:, None]
        kd.store(v_cache, row, head, pos, dim, kd.load(v, t, head, dim))


def _problem_args(problem: dict, device: str):
    q, k, v, positions, rows, inv_freq, kc, vc = _rope_cache_problem_args(problem, device)
    norms = [(1 + 0.1 * torch.randn(q.shape[2])).to(q.dtype).to(device) for _ in range(2)]
    return q, k, v, *norms, positions, rows, inv_freq, kc, vc


qk_norm_rope_cache_kernel.tuning(
    make_args=_problem_args,
    problems=[{"T": T, "Hq": 32, "Hk": 4, "D": 128, "R": 128, "dtype": "bf16"} for T in (1, 512)])


def serves(q, inv_freq) -> bool:
    """Full rotary width: the pair block that holds every pair of a head holds all of it."""
    return 2 * inv_freq.shape[0] == q.shape[-1]


def qk_norm_rope_cache_(q, k, v, q_norm, k_norm, eps, positions, rows, inv_freq, k_cache, v_cache, *,
                        weight_offset=0.0, interleaved=False) -> None:
    """kilnx.ops.qk_norm_rope_cache_: q (T, Hq, D) normalized per head by q_norm and rotated in place;
    k (T, Hk, D) normalized by k_norm and rotated, and v, written to k_cache / v_cache (B, Hk, S, D) at
    [rows[t], :, positions[t], :]."""
    if not serves(q, inv_freq) or q.shape[-1] != k.shape[-1] or k.shape != v.shape:
        raise ValueError(f"qk_norm_rope_cache_: needs the full rotary width (2 * {inv_freq.shape[0]} = head dim "
                         f"{q.shape[-1]}) and q, k, v sharing the head dim, k and v their shape (q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}); use rms_norm then rope_and_cache_")
    qk_norm_rope_cache_kernel(q, k, v, q_norm, k_norm, positions, rows, inv_freq, k_cache, v_cache, eps=float(eps),
                              offset=float(weight_offset), INTERLEAVED=bool(interleaved))
