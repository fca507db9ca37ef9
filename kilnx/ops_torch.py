"""Torch-eager peer of kilnx.ops: the same functions with the same semantics, in plain PyTorch.

Why it exists: it is the reference the DSL kernels are checked against in tests, the baseline that
benchmarks compare with, and a way to run every model before (or without) the tuned kernels.
Math is done in fp32 and results are cast back to the input dtype, exactly as kilnx.ops documents.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

NAME = "torch"


def _rms(x32: torch.Tensor, w: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return y * (w.float() + weight_offset)


def embedding(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return table[ids.reshape(-1)]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, *, weight_offset: float = 0.0) -> torch.Tensor:
    """y = x / sqrt(mean(x², -1) + eps) * (weight_offset + w), computed in fp32, returned in x.dtype."""
    return _rms(x.float(), w, eps, weight_offset).to(x.dtype)


def add_rms_norm(x, residual, w, eps: float, *, weight_offset: float = 0.0):
    """h = x + residual; returns (h, rms_norm(h, w)) both in x.dtype."""
    h32 = x.float() + residual.float()
    h = h32.to(x.dtype)
    # Normalise the rounded sum so the result equals rms_norm(h) whatever x.dtype is.
    return h, _rms(h.float(), w, eps, weight_offset).to(x.dtype)


def layer_norm(x, w, b, eps: float):
    y = F.layer_norm(x.float(), (x.shape[-1],), w.float(), None if b is None else b.float(), eps)
    return y.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2F) laid out [gate | up] -> silu(gate) * up, (..., F)."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(gate_up.dtype)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2F) laid out [gate | up] -> gelu_tanh(gate) * up, (..., F)."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return (F.gelu(g, approximate="tanh") * u).to(gate_up.dtype)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap)."""
    return (cap * torch.tanh(x.float() / cap)).to(x.dtype)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0)², in x.dtype (nemotron-h's MLP)."""
    return F.relu(x.float()).square().to(x.dtype)


def conv1d_silu_(x, weight, bias, state, positions, *, limit: int) -> torch.Tensor:
    """kilnx.ops.conv1d_silu_ in float64 torch (kernels/ssm.py's formula), the state updated in place."""
    from kilnx.kernels.ssm import conv1d_silu_formula
    out, new = conv1d_silu_formula(x, weight, bias, state, positions, limit=limit)
    state.copy_(new)
    return out


def ssm_scan_(x, dt, B, C, A_log, dt_bias, D, state, positions, *, limit: int, dt_min: float = 0.0,
              dt_max: float = float("inf")) -> torch.Tensor:
    """kilnx.ops.ssm_scan_ token by token in float64 torch (kernels/ssm.py's formula), the state updated in place."""
    from kilnx.kernels.ssm import ssm_scan_formula
    y, new = ssm_scan_formula(x, dt, B, C, A_log, dt_bias, D, state, positions, limit=limit, dt_min=dt_min,
                              dt_max=dt_max)
    state.copy_(new)
    return y


def gated_rms_norm(y, z, w, group: int, eps: float) -> torch.Tensor:
    from kilnx.kernels.ssm import gated_rms_norm_formula
    return gated_rms_norm_formula(y, z, w, group, eps)


def scaled_add(x: torch.Tensor, residual: torch.Tensor, scale: float) -> torch.Tensor:
    """residual + scale * x (per-layer residual scaling)."""
    return (residual.float() + scale * x.float()).to(x.dtype)


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
          interleaved: bool = False) -> None:
    """Rotate q (T, Hq, D) and k (T, Hk, D) in place at integer positions (T,).

    inv_freq (R/2,) fp32; R = 2 * len(inv_freq) <= D rotary dims, the rest pass through. neox layout
    pairs i with i + R/2; interleaved pairs 2i with 2i+1.
    """
    half = inv_freq.shape[0]
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(device=q.device, dtype=torch.float32)[None, :]
    cos = angles.cos()[:, None, :]   # (T, 1, R/2) broadcasts over heads
    sin = angles.sin()[:, None, :]
    for t in (q, k):
        r = t[..., : 2 * half]
        if interleaved:
            a, b = r[..., 0::2].float(), r[..., 1::2].float()
        else:
            a, b = r[..., :half].float(), r[..., half:].float()
        ra = (a * cos - b * sin).to(t.dtype)
        rb = (b * cos + a * sin).to(t.dtype)
        if interleaved:
            r[..., 0::2] = ra
            r[..., 1::2] = rb
        else:
            r[..., :half] = ra
            r[..., half:] = rb


def rope_and_cache_(q, k, v, positions, rows, inv_freq, k_cache, v_cache, *, interleaved: bool = False) -> None:
    """rope_ on q and k, then k and v written into the (B, Hk, S, D) caches at [rows[t], :, positions[t], :]."""
    rope_(q, k, positions, inv_freq, interleaved=interleaved)
    k_cache.transpose(1, 2)[rows, positions] = k.to(k_cache.dtype)
    v_cache.transpose(1, 2)[rows, positions] = v.to(v_cache.dtype)


# QWeight -> its dequantized dense matrix, per compute dtype. QWeight.dequantize evaluates the format
# on the CPU with numpy; doing that every step would make the eager peer measure numpy, not torch.
# The weak keys let the cache go with the model.
_DENSE_OF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def dense_weight(w, dtype: torch.dtype) -> torch.Tensor:
    """The dense (N, K) matrix a QWeight (or dense tensor) stands for, in `dtype`, cached per weight."""
    if isinstance(w, torch.Tensor):
        return w if w.dtype == dtype else w.to(dtype)
    per_dtype = _DENSE_OF.setdefault(w, {})
    if dtype not in per_dtype:
        per_dtype[dtype] = w.dequantize().to(dtype)
    return per_dtype[dtype]


def qmatmul(x: torch.Tensor, w) -> torch.Tensor:
    """x (..., K) @ w.T where w is a kilnx.quant.QWeight (N, K) or a dense (N, K) tensor -> (..., N)."""
    if x.dtype != torch.float32 and x.device.type == "cpu":
        return F.linear(x.float(), dense_weight(w, torch.float32)).to(x.dtype)
    # fp32 inputs accumulate in fp32; CUDA bf16/fp16 GEMMs accumulate in fp32 internally.
    return F.linear(x, dense_weight(w, x.dtype))


def _expert_rows(xs: torch.Tensor, w, flat_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Row i of the result = xs[rows[i]] @ W[flat_ids[i]].T, one GEMM per expert used (eager: the
    loop reads the routing on the host)."""
    dt = torch.float32 if xs.dtype != torch.float32 and xs.device.type == "cpu" else xs.dtype
    W = dense_weight(w, dt)
    out = torch.empty(flat_ids.numel(), W.shape[1], dtype=dt, device=xs.device)
    for e in flat_ids.unique().tolist():
        sel = (flat_ids == e).nonzero().flatten()
        out[sel] = F.linear(xs[rows[sel]].to(dt), W[e])
    return out.to(xs.dtype)


def gather_qmatmul(x: torch.Tensor, w, expert_ids: torch.Tensor) -> torch.Tensor:
    """x (..., K), w an expert stack (E, N, K), expert_ids (..., top_k) -> (..., top_k, N):
    out[..., k, :] = x[...] @ w[expert_ids[..., k]].T."""
    top_k = expert_ids.shape[-1]
    flat = expert_ids.reshape(-1)
    y = _expert_rows(x.reshape(-1, x.shape[-1]), w, flat, torch.arange(flat.numel(), device=x.device) // top_k)
    return y.reshape(*expert_ids.shape, -1)


def moe(x: torch.Tensor, w_gate_up, w_down, expert_ids: torch.Tensor, routing_weights: torch.Tensor,
        activation: str = "silu") -> torch.Tensor:
    """sum_k routing_weights[.., k] * down_e(act(gate_e x) * up_e x) with e = expert_ids[.., k];
    w_gate_up (E, 2F, H) laid out [gate | up], w_down (E, H, F); activation "relu2": w_gate_up is up
    alone (E, F, H), the expert down_e(relu(up_e x)²). The activation product is rounded to
    x.dtype before the down projection (as kilnx.ops.moe does); the weighted sum is in fp32."""
    if activation == "relu2":     # experts without a gate: w_gate_up is up alone
        up = gather_qmatmul(x, w_gate_up, expert_ids).float()
        h = F.relu(up).square().to(x.dtype).reshape(-1, up.shape[-1])
    else:
        gate, up = gather_qmatmul(x, w_gate_up, expert_ids).float().chunk(2, dim=-1)
        act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
        h = (act * up).to(x.dtype).reshape(-1, gate.shape[-1])
    flat = expert_ids.reshape(-1)
    y = _expert_rows(h, w_down, flat, torch.arange(flat.numel(), device=x.device))
    y = y.float().reshape(*expert_ids.shape, -1) * routing_weights.float()[..., None]
    return y.sum(-2).to(x.dtype)


def moe_route(logits: torch.Tensor, top_k: int, normalize: bool, *, scoring: str = "softmax",
              bias: torch.Tensor | None = None, scale: float = 1.0):
    """(expert ids (T, top_k) int32, weights (T, top_k) fp32): the top_k of softmax(logits) in fp32
    (ties to the lower expert), divided by their sum when `normalize`. scoring="sigmoid" (DeepSeek-V3's,
    nemotron-3's): the top_k of sigmoid(logits) + bias, weighted by their sigmoid scores (divided by the
    scores' sum + 1e-20 when `normalize`), times `scale`."""
    if scoring == "sigmoid":
        s = torch.sigmoid(logits.float())
        choice = s if bias is None else s + bias.float()
        ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
        w = s.gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) if normalize else w
        return ids.to(torch.int32), w * scale
    p = torch.softmax(logits.float(), dim=-1)
    order = torch.sort(p, dim=-1, descending=True, stable=True)
    w, ids = order.values[:, :top_k], order.indices[:, :top_k]
    return ids.to(torch.int32), (w / w.sum(-1, keepdim=True) if normalize else w)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
              scale: float, *, softcap: float | None = None, window: int | None = None,
              limit: int | None = None) -> torch.Tensor:
    """Causal attention of new queries over a KV cache.

    q (B, T, Hq, D); k_cache, v_cache (B, Hk, S, D) holding the new keys at their positions;
    positions (B, T): query t of row b sees keys j <= positions[b, t] (and j > positions - window with
    a sliding window); a query at `limit` or past it is parked: no key, output 0. Hq is a multiple of Hk.
    Returns (B, T, Hq, D).
    """
    from kilnx.kernels.attention import parked_formula
    B, T, Hq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    positions = parked_formula(positions, limit)
    if not _capturing(q):
        # Keys past the furthest query position are masked anyway; skipping them saves the work of a
        # mostly empty static cache. Not done under CUDA-graph capture, where .item() cannot sync.
        S = max(min(S, int(positions.max().item()) + 1), 1)
    k = k_cache[:, :, :S].float()
    v = v_cache[:, :, :S].float()
    G = Hq // Hk
    # Fold the query heads sharing a KV head into the row axis: one batched GEMM per KV head.
    qf = q.float().view(B, T, Hk, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hk, G * T, D)
    scores = torch.matmul(qf, k.transpose(-1, -2)).mul_(scale).view(B, Hk, G, T, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    j = torch.arange(S, device=q.device)
    pos = positions.to(q.device)[:, None, None, :, None]                   # (B, 1, 1, T, 1)
    visible = j <= pos
    if window is not None:
        visible = visible & (j > pos - window)
    scores = scores.masked_fill(~visible, -math.inf)
    probs = torch.softmax(scores, dim=-1).masked_fill(~visible.any(-1, keepdim=True), 0.0).view(B, Hk, G * T, S)
    out = torch.matmul(probs, v).view(B, Hk, G, T, D)
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D).to(q.dtype)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of the largest value along the last axis (first on ties), int64."""
    return torch.argmax(logits, dim=-1)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def attention_new_tokens(q, k, v, positions, rows, inv_freq, k_cache, v_cache, scale: float, *,
                         softcap: float | None = None, window: int | None = None, limit: int | None = None,
                         interleaved: bool = False, prepared=None) -> torch.Tensor:
    """rope_and_cache_ of the new tokens' q (B*T, Hq, D), k, v (B*T, Hk, D), then attention: (B, T, Hq, D).
    The eager peer has no prepared activations (it offers no prepared_format), so `prepared` is None."""
    if prepared is not None:
        raise ValueError("the torch ops write no prepared activations; pass prepared=None")
    B, T = positions.shape
    rope_and_cache_(q, k, v, positions.reshape(-1), rows, inv_freq, k_cache, v_cache, interleaved=interleaved)
    return attention(q.view(B, T, q.shape[1], q.shape[2]), k_cache, v_cache, positions, scale, softcap=softcap,
                     window=window, limit=limit)
