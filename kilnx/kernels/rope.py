"""Rotary position embedding, applied in place to q and k.

One program per token: it computes cos/sin of position * inv_freq for a block of rotary pairs once
and applies them to every head of q and then of k (blocks of BLOCK_H heads). Dims past the rotary
width R = 2 * len(inv_freq) are never touched (partial rotary). Addresses go through strides, so q
and k may be views (e.g. column slices of one fused qkv projection output) and are rotated where
they live.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd
from kilnx.kernels._tuning import DTYPES
from kilnx.kernels.sizes import pow2_at_least


def _rope_key(q, k, positions, inv_freq, **_):
    return {"T": q.shape[0], "Hq": q.shape[1], "Hk": k.shape[1], "D": q.shape[2], "R": 2 * inv_freq.shape[0]}


def _rope_default(q, k, positions, inv_freq, **_):
    # all pairs of a head in one block, and enough heads per block that a decode step (T=1) is not a
    # long serial loop
    return {"BLOCK_R": min(max(pow2_at_least(inv_freq.shape[0]), 8), 256),
            "BLOCK_H": min(pow2_at_least(max(q.shape[1], k.shape[1])), 16)}


def rotated(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (T, H, D) rotated at positions: the float64 formula, returned as a new tensor in x.dtype.
    Angles are formed in fp32 (position * inv_freq) as every implementation does, then widened."""
    half = inv_freq.shape[0]
    angle = (positions.to(torch.float32)[:, None] * inv_freq.to(x.device, torch.float32)[None, :]).double()
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    out = x.double().clone()
    if interleaved:
        a, b = out[..., 0:2 * half:2].clone(), out[..., 1:2 * half:2].clone()
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = out[..., :half].clone(), out[..., half:2 * half].clone()
        out[..., :half], out[..., half:2 * half] = a * cos - b * sin, b * cos + a * sin
    return out.to(x.dtype)


def _rope_spec(q, k, positions, inv_freq, *, INTERLEAVED=False, **_):
    """The meaning of rope_kernel: (q, k) rotated, as new tensors (the kernel rotates in place and
    returns the same tensors it was given)."""
    return rotated(q, positions, inv_freq, INTERLEAVED), rotated(k, positions, inv_freq, INTERLEAVED)


class InPlaceAsOutputs:
    """A kernel that writes into some of its arguments, seen by the tuner as one that returns them.

    The tuner's gate compares what a kernel returns with its reference; an in-place kernel returns
    nothing, so this wrapper returns the mutated arguments after each call. Everything else (name,
    source hash, key, tunables) is the wrapped kernel's, so tuned configs apply to it directly.
    """

    def __init__(self, kernel, mutated: tuple[int, ...]):
        self.kernel, self.mutated = kernel, mutated

    @classmethod
    def of(cls, mutated: tuple[int, ...]):
        return lambda kernel: cls(kernel, mutated)

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def tuning(self, **kw):
        self.kernel.tuning(**kw)
        return self

    def compile(self, config, *args, backend=None, **kw):
        run = self.kernel.compile(config, *args, backend=backend, **kw)

        def run_and_return(*a, **k):
            run(*a, **k)
            return tuple(a[i] for i in self.mutated)
        return run_and_return

    def __call__(self, *args, backend=None, config=None, **kw):
        self.kernel(*args, backend=backend, config=config, **kw)
        return tuple(args[i] for i in self.mutated)


@InPlaceAsOutputs.of(mutated=(0, 1))
@kd.kernel(
    tune={"BLOCK_H": kd.pow2(1, 64, default=8), "BLOCK_R": kd.pow2(8, 256, default=64),
          "num_warps": kd.choice(1, 2, 4, 8, default=2)},
    key=_rope_key, default=_rope_default, spec=_rope_spec)
def rope_kernel(q, k, positions, inv_freq, *, INTERLEAVED: kd.constexpr = False, BLOCK_H, BLOCK_R):
    t = kd.grid(q.shape[0])
    pos = kd.load(positions, t).f32()
    for r0 in kd.range(0, inv_freq.shape[0], BLOCK_R):
        rot = _rotation(pos, inv_freq, r0, BLOCK_R, INTERLEAVED)
        for x in (q, k):
            _rotate_heads(x, t, rot, BLOCK_H, lambda head, x=x: (x, t, head))


def _rotation(pos, inv_freq, r0, BLOCK_R: int, interleaved: bool):
    """(mask, cos, sin, dim_a, dim_b) of rotary pairs r0.. at position pos (fp32), as (1, BLOCK_R) tiles:
    neox pairs dim i with i + R/2, interleaved 2i with 2i + 1. Lanes past R/2 are masked, else they would
    rotate pass-through dims."""
    half = inv_freq.shape[0]
    pair = r0 + kd.arange(0, BLOCK_R)
    angle = pos * kd.load(inv_freq, pair).f32()
    if interleaved:
        dim_a, dim_b = (2 * pair)[None, :], (2 * pair + 1)[None, :]
    else:
        dim_a, dim_b = pair[None, :], (pair + half)[None, :]
    return (pair < half)[None, :], kd.cos(angle)[None, :], kd.sin(angle)[None, :], dim_a, dim_b


def rotated_tile(x, *idx, d, pos, inv_freq, interleaved: bool):
    """x[idx..., d] rotated at position(s) `pos` (broadcasting against the index tiles), as fp32: one
    load of each dim and one of its pair partner, for kernels that rotate what they load (decode
    attention). Dims past the rotary width come back unchanged."""
    half = inv_freq.shape[0]
    in_rot = d < 2 * half
    if interleaved:
        pair, partner, sign = d // 2, d + 1 - 2 * (d % 2), 2.0 * (d % 2).f32() - 1.0
    else:
        low = d < half
        pair = kd.where(low, d, d - half)
        partner, sign = kd.where(low, d + half, d - half), kd.where(low, -1.0, 1.0)
    angle = pos.f32() * kd.load(inv_freq, pair, mask=in_rot).f32()
    a = kd.load(x, *idx, d).f32()
    b = kd.load(x, *idx, partner, mask=in_rot).f32()
    return kd.where(in_rot, a * kd.cos(angle) + sign * b * kd.sin(angle), a)


def _rotate_heads(x, t, rot, BLOCK_H: int, dest):
    """Every head of token t of x (T, H, D) rotated by `rot`, stored at dest(head) + (dim,): x itself
    for an in-place rotation, or elsewhere (a KV-cache row)."""
    in_rotary, cos, sin, dim_a, dim_b = rot
    for h0 in kd.range(0, x.shape[1], BLOCK_H):
        head = (h0 + kd.arange(0, BLOCK_H))[:, None]
        # upcast right after loading: 16-bit arithmetic is not trusted (see design notes)
        a = kd.load(x, t, head, dim_a, mask=in_rotary).f32()
        b = kd.load(x, t, head, dim_b, mask=in_rotary).f32()
        kd.store(*dest(head), dim_a, a * cos - b * sin, mask=in_rotary)
        kd.store(*dest(head), dim_b, b * cos + a * sin, mask=in_rotary)


def _rope_problem_args(problem: dict, device: str):
    """{T, Hq, Hk, D, R, dtype} -> (q, k, positions, inv_freq); positions spread over a long context."""
    dt = DTYPES[problem.get("dtype", "bf16")]
    # the global generator: the tuner seeds it per draw, so gate inputs differ from timing inputs
    T, D, R = problem["T"], problem["D"], problem.get("R", problem["D"])
    q = torch.randn(T, problem["Hq"], D).to(dt).to(device)
    k = torch.randn(T, problem["Hk"], D).to(dt).to(device)
    positions = torch.randint(0, 8192, (T,)).to(device)
    inv_freq = (500000.0 ** (-torch.arange(0, R, 2, dtype=torch.float32) / R)).to(device)
    return q, k, positions, inv_freq


rope_kernel.tuning(
    make_args=_rope_problem_args,
    problems=[{"T": T, "Hq": 32, "Hk": 8, "D": 128, "R": 128, "dtype": "bf16"} for T in (1, 16, 512, 4096)]
    + [{"T": T, "Hq": 8, "Hk": 1, "D": 256, "R": 256, "dtype": "bf16"} for T in (1, 512)])


def rope_(q, k, positions, inv_freq, *, interleaved=False) -> None:
    """kilnx.ops.rope_: rotate q (T, Hq, D) and k (T, Hk, D) in place at positions (T,)."""
    if 2 * inv_freq.shape[0] > q.shape[-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"rope_: rotary width {2 * inv_freq.shape[0]} must be <= head dim, and q, k must "
                         f"share it (q {tuple(q.shape)}, k {tuple(k.shape)})")
    rope_kernel(q, k, positions, inv_freq, INTERLEAVED=bool(interleaved))


# ---- rope + KV-cache write in one launch -------------------------------------------------------------
# A decode step used to rotate q and k (after copying both out of the fused qkv output), then write k and
# v into the cache with two indexing ops and an arange: six launches per layer, each a few microseconds
# of almost no work. This kernel reads q, k, v where the qkv projection left them, rotates q in place,
# and writes rotated k and plain v straight into the cache.
def _rope_cache_key(q, k, v, positions, rows, inv_freq, k_cache, v_cache, **_):
    return {"T": q.shape[0], "Hq": q.shape[1], "Hk": k.shape[1], "D": q.shape[2], "R": 2 * inv_freq.shape[0]}


def _rope_cache_default(q, k, v, positions, rows, inv_freq, k_cache, v_cache, **_):
    return {"BLOCK_R": min(max(pow2_at_least(inv_freq.shape[0]), 8), 256),
            "BLOCK_D": min(max(pow2_at_least(q.shape[2]), 16), 256),
            "BLOCK_H": min(pow2_at_least(max(q.shape[1], k.shape[1])), 16)}


def _rope_cache_spec(q, k, v, positions, rows, inv_freq, k_cache, v_cache, *, INTERLEAVED=False, **_):
    """q rotated; the caches with rotated k and v written at [rows[t], :, positions[t], :]."""
    kc, vc = k_cache.clone(), v_cache.clone()
    # into a narrower cache (fp8) from fp32, as the kernel rounds once from its fp32 rotation
    kr = rotated(k if kc.dtype == k.dtype else k.float(), positions, inv_freq, INTERLEAVED)
    kc.transpose(1, 2)[rows.long(), positions.long()] = kr.to(kc.dtype)
    vc.transpose(1, 2)[rows.long(), positions.long()] = v.to(vc.dtype)
    return rotated(q, positions, inv_freq, INTERLEAVED), kc, vc


@InPlaceAsOutputs.of(mutated=(0, 6, 7))
@kd.kernel(
    tune={"BLOCK_H": kd.pow2(1, 64, default=8), "BLOCK_R": kd.pow2(8, 256, default=64),
          "BLOCK_D": kd.pow2(16, 256, default=128), "num_warps": kd.choice(1, 2, 4, 8, default=2)},
    key=_rope_cache_key, default=_rope_cache_default, spec=_rope_cache_spec)
def rope_cache_kernel(q, k, v, positions, rows, inv_freq, k_cache, v_cache, *, INTERLEAVED: kd.constexpr = False,
                      BLOCK_H, BLOCK_R, BLOCK_D):
    T, D = q.shape[0], q.shape[2]
    Hk = k.shape[1]
    half = inv_freq.shape[0]
    t = kd.grid(T)
    pos = kd.load(positions, t)
    row = kd.load(rows, t)
    # v, and the dims of k past the rotary width, go to the cache unchanged
    for d0 in kd.range(0, D, BLOCK_D):
        dim = (d0 + kd.arange(0, BLOCK_D))[None, :]
        for h0 in kd.range(0, Hk, BLOCK_H):
            head = (h0 + kd.arange(0, BLOCK_H))[:, None]
            kd.store(v_cache, row, head, pos, dim, kd.load(v, t, head, dim))
            tail = dim >= 2 * half
            kd.store(k_cache, row, head, pos, dim, kd.load(k, t, head, dim, mask=tail), mask=tail)
    angle_pos = pos.f32()
    for r0 in kd.range(0, half, BLOCK_R):
        rot = _rotation(angle_pos, inv_freq, r0, BLOCK_R, INTERLEAVED)
        _rotate_heads(q, t, rot, BLOCK_H, lambda head: (q, t, head))
        _rotate_heads(k, t, rot, BLOCK_H, lambda head: (k_cache, row, head, pos))


def _rope_cache_problem_args(problem: dict, device: str):
    q, k, positions, inv_freq = _rope_problem_args(problem, device)
    T, Hk, D = k.shape
    S = 8192
    v = torch.randn_like(k)
    kc = torch.zeros(1, Hk, S, D, dtype=k.dtype, device=device)
    return q, k, v, positions, torch.zeros_like(positions), inv_freq, kc, torch.zeros_like(kc)


rope_cache_kernel.tuning(
    make_args=_rope_cache_problem_args,
    problems=[{"T": T, "Hq": 32, "Hk": 8, "D": 128, "R": 128, "dtype": "bf16"} for T in (1, 512)])


def rope_and_cache_(q, k, v, positions, rows, inv_freq, k_cache, v_cache, *, interleaved=False) -> None:
    """kilnx.ops.rope_and_cache_: q (T, Hq, D) rotated in place; rotated k and v (T, Hk, D) written to
    k_cache / v_cache (B, Hk, S, D) at [rows[t], :, positions[t], :]."""
    if 2 * inv_freq.shape[0] > q.shape[-1] or q.shape[-1] != k.shape[-1] or k.shape != v.shape:
        raise ValueError(f"rope_and_cache_: rotary width {2 * inv_freq.shape[0]} must be <= head dim, q, k, v must "
                         f"share it and k, v their shape (q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})")
    rope_cache_kernel(q, k, v, positions, rows, inv_freq, k_cache, v_cache, INTERLEAVED=bool(interleaved))
