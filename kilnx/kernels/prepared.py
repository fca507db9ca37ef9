"""Producers that emit qmv_h2's prepared activations directly: residual-add + RMSNorm and SwiGLU.

Why: at decode every qmv_h2 call was two launches, `qmv_h2_prep` (x -> packed fp16 planes, group sums,
group scales) and the GEMV. Three of a llama layer's four GEMV inputs come straight out of an
add+RMSNorm (qkv, gate/up) or a SwiGLU (down), so those kernels write the prepared form in place of
their bf16 output: one launch and one activation round trip fewer per GEMV input (the prep was 6% of
llama-3.1-8b's decode GPU time on the H200, 66 launches of ~1.1 us each per step).

The values are those of the two-kernel path bit for bit: each producer rounds its result to the
activation dtype before preparing it, as the stored-then-prepared activation was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kilnx.dsl as kd
from kilnx.dsl.kernel import PerObjectMemo
from kilnx.kernels import qmv_h2 as H
from kilnx.kernels.sizes import pow2_at_least


@dataclass(frozen=True)
class PreparedX:
    """Activations x (M, K) in qmv_h2's input form; `kilnx.ops.qmatmul` takes it in place of x for
    weights of the format it was prepared for (`prepared_format`)."""
    planes: torch.Tensor            # (M, PER/2, K/PER) uint32: fp16 pairs
    sums: torch.Tensor              # (M, K/GROUP) fp32
    xs: torch.Tensor                # (M, K/GROUP) fp32: each group's power-of-two scale
    dtype: torch.dtype              # the activation dtype the GEMV's output takes

    @property
    def shape(self) -> tuple[int, int]:
        m, half, kw = self.planes.shape
        return m, 2 * half * kw

    @property
    def format(self) -> tuple[int, int]:
        """(PER, GROUP): codes per packed word, quantization group size."""
        m, k = self.shape
        return 2 * self.planes.shape[1], k // self.sums.shape[1]

    @property
    def device(self) -> torch.device:
        return self.planes.device


_FORMATS = PerObjectMemo()
"""parts, (rows, K, device) -> answer: a model asks for every linear layer of every step; the answer
changes only with the route's stored choice."""


def prepared_format(parts, x: torch.Tensor) -> tuple[int, int] | None:
    """(PER, GROUP) when every weight in `parts` would multiply activations shaped like x (rows, K)
    through qmv_h2 (the route's choice for this device and row count) in one shared format; else None,
    and the caller produces plain activations. A stacked (E, N, K) weight stands for an MoE layer's
    experts, which take prepared x where moe_h2.takes_prepared says."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    known = _FORMATS.get(tuple(parts), (rows, k, x.device))
    if known is not PerObjectMemo.MISSING:
        return known
    return _FORMATS.put(tuple(parts), (rows, k, x.device), _prepared_format(parts, x.reshape(rows, k)))


def prepared_format_for(parts, rows: int, k: int, device: torch.device, dtype: torch.dtype):
    """prepared_format for activations (rows, k) that do not exist yet (a producer that asks before it computes
    them: kernels/swiglu_prep.py). A tensor is made only the first time (a step recorded for replay on the CPU may
    call no torch function outside the kernels, runtime/engine.py's _TorchGuard)."""
    known = _FORMATS.get(tuple(parts), (rows, k, device))
    if known is not PerObjectMemo.MISSING:
        return known
    return prepared_format(parts, torch.empty((rows, k), dtype=dtype, device=device))


def _prepared_format(parts, x):
    from kilnx.kernels.routing import qmatmul_rows
    from kilnx.quant import QWeight
    rows, k = x.shape
    fmt = None
    for w in parts:
        if isinstance(w, QWeight) and len(w.shape) == 3:      # an MoE layer's stacked experts (gate_up)
            from kilnx.kernels.moe_h2 import takes_prepared
            if not takes_prepared(x, w):
                return None
        elif not isinstance(w, QWeight) or w.mode != "affine" or len(w.shape) != 2 or w.bits not in H.BITS_SERVED:
            return None
        else:
            args = (x, w.packed, w.scales, w.biases)
            if qmatmul_rows.path(*args, qmatmul_rows.choice_for(*args)) != "qmv_h2":
                return None
        f = (32 // w.bits, w.group_size)
        if fmt not in (None, f) or k % w.group_size:
            return None
        fmt = f
    return fmt


def _norm_spec(x, res, w, *, eps, offset, PER, GROUP, **_):
    h = x.float() + res.float()
    y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.float())).to(x.dtype)
    return (h.to(x.dtype), *H._prep_spec(y.float(), PER=PER, GROUP=GROUP))


@kd.kernel(tune={"num_warps": kd.choice(1, 2, 4, 8, 16, default=8)},
           key=lambda x, res, w, **kw: {"M": x.shape[0], "K": x.shape[1]}, spec=_norm_spec,
           specialize=lambda x, res, w: {"K_P2": pow2_at_least(x.shape[1])})
def add_rms_norm_prep(x, res, w, *, eps: float, offset: float, PER: kd.constexpr, GROUP: kd.constexpr,
                      K_P2: kd.constexpr):
    """h = x + res (returned in x.dtype) and rms_norm(h) * (offset + w), prepared for qmv_h2: one
    program per row, which holds the whole row (the norm needs all of it) in whole groups."""
    M, K = x.shape
    BW = max(K_P2 // PER, GROUP // PER)
    row = kd.grid(M)
    words = kd.arange(0, BW)
    lo_i, hi_i = H.code_pairs_index(words, PER)
    # the norm weight is loaded with the row: loaded after the residual's stores, it could not be issued
    # before them (the compiler cannot rule out aliasing) and cost a memory round trip of its own
    w_lo, w_hi = offset + kd.load(w, lo_i).f32(), offset + kd.load(w, hi_i).f32()
    lo = kd.load(x, row, lo_i).f32() + kd.load(res, row, lo_i).f32()
    hi = kd.load(x, row, hi_i).f32() + kd.load(res, row, hi_i).f32()
    h = kd.output((M, K), x.dtype, name="residual")
    kd.store(h, row, lo_i, lo)
    kd.store(h, row, hi_i, hi)
    # the norm of the fp32 sum, as add_rms_norm_kernel (not of h rounded to x.dtype)
    inv = kd.rsqrt((kd.sum(kd.sum(lo * lo, axis=1), axis=0) + kd.sum(kd.sum(hi * hi, axis=1), axis=0)) / K + eps)
    y_lo = (lo * inv * w_lo).astype(x.dtype).f32()
    y_hi = (hi * inv * w_hi).astype(x.dtype).f32()
    return (h, *H.store_prepared(y_lo, y_hi, row, 0, words, M, K, PER=PER, GROUP=GROUP))


def _silu_spec(gate_up, *, PER, GROUP, **_):
    f = gate_up.shape[-1] // 2
    y = (torch.nn.functional.silu(gate_up[..., :f].float()) * gate_up[..., f:].float()).to(gate_up.dtype)
    return H._prep_spec(y.float(), PER=PER, GROUP=GROUP)


@kd.kernel(tune={"BLOCK_KW": kd.pow2(16, 512, default=128), "num_warps": kd.choice(1, 2, 4, default=4)},
           key=lambda gate_up, **kw: {"M": gate_up.shape[0], "K": gate_up.shape[1] // 2}, spec=_silu_spec)
def silu_mul_prep(gate_up, *, PER: kd.constexpr, GROUP: kd.constexpr, BLOCK_KW):
    """silu(gate) * up of a [gate | up] row (M, 2F), rounded to its dtype, prepared for qmv_h2."""
    M, F2 = gate_up.shape
    F = F2 // 2
    BW = max(BLOCK_KW, GROUP // PER)
    row, pw = kd.grid(M, kd.cdiv(kd.cdiv(F, PER), BW))
    words = pw * BW + kd.arange(0, BW)
    lo_i, hi_i = H.code_pairs_index(words, PER)
    # words past F would read into `up`: their lanes are masked to 0 (and not stored)
    lo_in, hi_in = lo_i < F, hi_i < F
    lo = kd.silu(kd.load(gate_up, row, lo_i, mask=lo_in).f32()) * kd.load(gate_up, row, lo_i + F, mask=lo_in).f32()
    hi = kd.silu(kd.load(gate_up, row, hi_i, mask=hi_in).f32()) * kd.load(gate_up, row, hi_i + F, mask=hi_in).f32()
    return H.store_prepared(lo.astype(gate_up.dtype).f32(), hi.astype(gate_up.dtype).f32(), row, pw * BW, words,
                            M, F, PER=PER, GROUP=GROUP)


def prepare(x, fmt) -> PreparedX:
    """x (M, K) prepared by qmv_h2_prep in format `fmt` (PER, GROUP): for producers without a fused
    variant (the one-pass attention)."""
    per, group = fmt
    planes, sums, xs = H.qmv_h2_prep(x, PER=per, GROUP=group)
    return PreparedX(planes, sums, xs, x.dtype)


def add_rms_norm_prepared(x, residual, w, eps, fmt, *, weight_offset=0.0):
    """(h, PreparedX of rms_norm(h)) for x, residual (..., K) -> h in x's shape."""
    per, group = fmt
    k = x.shape[-1]
    h, planes, sums, xs = add_rms_norm_prep(x.reshape(-1, k), residual.reshape(-1, k), w, eps=float(eps),
                                            offset=float(weight_offset), PER=per, GROUP=group)
    return h.view(x.shape), PreparedX(planes, sums, xs, x.dtype)


def silu_mul_prepared(gate_up, fmt):
    per, group = fmt
    planes, sums, xs = silu_mul_prep(gate_up.reshape(-1, gate_up.shape[-1]), PER=per, GROUP=group)
    return PreparedX(planes, sums, xs, gate_up.dtype)


def qmatmul_prepared(x: PreparedX, w) -> torch.Tensor:
    """x @ w.T for prepared activations: qmv_h2 alone, (M, N) in x.dtype."""
    m, k = x.shape
    if len(w.shape) != 2 or w.shape[1] != k or (32 // w.bits, w.group_size) != x.format or w.mode != "affine":
        raise ValueError(f"qmatmul: activations prepared as (codes per word, group) {x.format} for K={k} "
                         f"cannot multiply a {w.bits}-bit gs{w.group_size} {w.mode} weight {tuple(w.shape)}; "
                         "ask prepared_format(parts, x) before preparing")
    y = H.qmv_h2(x.planes, x.sums, x.xs, w.packed, w.scales, w.biases)
    return y if y.dtype == x.dtype else y.to(x.dtype)
