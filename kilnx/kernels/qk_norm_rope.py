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
from kilnx.kernels.rope import InPlaceAsOutputs, _rope_cache_problem_args, _rope_cache_spec, _rotation
from kilnx.kernels.sizes import pow2_at_least


def _norm_spec(x, w, eps, offset):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.float())).to(x.dtype)


def _spec(q, k, v, q_norm, k_norm, positions, rows, inv_freq, k_cache, v_cache, *, eps=1e-6, offset=0.0,
          INTERLEAVED=False, **_):
    """q normalized per head and rotated; the caches with k normalized and rotated and v written at
    [rows[t], :, positions[t], :]."""
    return _rope_cache_spec(_norm_spec(q, q_norm, eps, offset), _norm_spec(k, k_norm, eps, offset), v, positions,
                            rows, inv_freq, k_cache, v_cache, INTERLEAVED=INTERLEAVED)


def _key(q, k, v, q_norm, k_norm, positions, *_, **__):
    return {"T": q.shape[0], "Hq": q.shape[1], "Hk": k.shape[1], "D": q.shape[2]}


def _default(q, k, *_, **__):
    """On the GPU a head per program for a few tokens (a decode step's 40-odd programs each make one memory
    round trip, where one program walking the heads made one per head block: qwen3-8b decode +6.4% against
    +0.8%), blocks of heads for prefill. On the CPU (numba) every head in one program: a CPU tune of
    qwen3-0.6b's decode bucket took 16.3 us with 32 heads a program against 27.2 with one."""
    if not q.is_cuda:
        return {"BLOCK_H": min(pow2_at_least(q.shape[1] + k.shape[1]), 64)}
    return {"BLOCK_H": 1 if q.shape[0] <= 16 else 8, "num_warps": 1 if q.shape[0] <= 16 else 4}


@InPlaceAsOutputs.of(mutated=(0, 8, 9))
@kd.kernel(tune={"BLOCK_H": kd.pow2(1, 64, default=8), "num_warps": kd.choice(1, 2, 4, 8, default=2)},
           key=_key, default=_default, spec=_spec,
           specialize=lambda q, k, v, qn, kn, positions, rows, inv_freq, kc, vc: {
               "HALF": pow2_at_least(inv_freq.shape[0]), "BLOCK_D": pow2_at_least(q.shape[2])})
def qk_norm_rope_cache_kernel(q, k, v, q_norm, k_norm, positions, rows, inv_freq, k_cache, v_cache, *,
                              eps: float = 1e-6, offset: float = 0.0, INTERLEAVED: kd.constexpr = False,
                              HALF: kd.constexpr, BLOCK_D: kd.constexpr, BLOCK_H):
    """A program per token and block of BLOCK_H heads of [q heads | k heads]: each q head normalized and
    rotated in place; each k head normalized, rotated and written to k_cache, its v head copied to
    v_cache. Full rotary width only (2 * len(inv_freq) = D). Heads of both kinds in one block read
    through masked loads of q and of k (a masked lane touches no memory)."""
    T, Hq, D = q.shape
    Hk = k.shape[1]
    t, hb = kd.grid(T, kd.cdiv(Hq + Hk, BLOCK_H))
    h = (hb * BLOCK_H + kd.arange(0, BLOCK_H))[:, None]
    is_q, is_k = h < Hq, (h >= Hq) & (h < Hq + Hk)
    hq, hk = kd.minimum(h, Hq - 1), kd.where(is_k, h - Hq, 0)     # in-bounds indices for masked lanes
    pos = kd.load(positions, t)
    row = kd.load(rows, t)
    in_rot, cos, sin, dim_a, dim_b = _rotation(pos.f32(), inv_freq, 0, HALF, INTERLEAVED)   # every pair
    qa, ka = in_rot & is_q, in_rot & is_k
    a = kd.load(q, t, hq, dim_a, mask=qa).f32() + kd.load(k, t, hk, dim_a, mask=ka).f32()
    b = kd.load(q, t, hq, dim_b, mask=qa).f32() + kd.load(k, t, hk, dim_b, mask=ka).f32()
    w_a = offset + kd.where(is_q, kd.load(q_norm, dim_a, mask=in_rot).f32(), kd.load(k_norm, dim_a, mask=in_rot).f32())
    w_b = offset + kd.where(is_q, kd.load(q_norm, dim_b, mask=in_rot).f32(), kd.load(k_norm, dim_b, mask=in_rot).f32())
    inv = kd.rsqrt((kd.sum(a * a, axis=1) + kd.sum(b * b, axis=1)) / D + eps)[:, None]
    # rounded as rms_norm's output was, before the rotation reads it
    a = (a * inv * w_a).astype(q.dtype).f32()
    b = (b * inv * w_b).astype(q.dtype).f32()
    ra, rb = a * cos - b * sin, b * cos + a * sin
    kd.store(q, t, hq, dim_a, ra, mask=qa)
    kd.store(q, t, hq, dim_b, rb, mask=qa)
    kd.store(k_cache, row, hk, pos, dim_a, ra, mask=ka)
    kd.store(k_cache, row, hk, pos, dim_b, rb, mask=ka)
    dim = kd.arange(0, BLOCK_D)[None, :]
    kd.store(v_cache, row, hk, pos, dim, kd.load(v, t, hk, dim, mask=is_k), mask=is_k)


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
