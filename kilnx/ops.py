"""Public ops: the calls models make. Each dispatches to a DSL kernel with its tuned config.

Shapes: activations are (..., D) with rows along the last axis. This is the contract the model zoo
is written against.
"""

from __future__ import annotations

import torch


def embedding(table, ids: torch.Tensor) -> torch.Tensor:
    """Rows of `table` (V, H) at integer `ids` (any shape, flattened) -> (n, H); a QuantEmbedding's rows
    dequantized and scaled in its dtype."""
    from kilnx.kernels import embedding as e
    from kilnx.models.weights import QuantEmbedding
    if isinstance(table, QuantEmbedding):
        return e.embedding_quant(table.weight, ids, table.scale, table.dtype)
    return e.embedding(table, ids)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, *, weight_offset: float = 0.0) -> torch.Tensor:
    """y = x / sqrt(mean(x², -1) + eps) * (weight_offset + w), computed in fp32, returned in x.dtype."""
    from kilnx.kernels import norms
    return norms.rms_norm(x, w, eps, weight_offset=weight_offset)


def add_rms_norm(x, residual, w, eps: float, *, weight_offset: float = 0.0):
    """h = x + residual; returns (h, rms_norm(h, w)) both in x.dtype."""
    from kilnx.kernels import norms
    return norms.add_rms_norm(x, residual, w, eps, weight_offset=weight_offset)


def layer_norm(x, w, b, eps: float):
    from kilnx.kernels import norms
    return norms.layer_norm(x, w, b, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2F) laid out [gate | up] -> silu(gate) * up, (..., F)."""
    from kilnx.kernels import activations
    return activations.silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2F) laid out [gate | up] -> gelu_tanh(gate) * up, (..., F)."""
    from kilnx.kernels import activations
    return activations.gelu_tanh_mul(gate_up)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0)², in x.dtype (nemotron-h's MLP)."""
    from kilnx.kernels import activations
    return activations.relu2(x)


def conv1d_silu_(x: torch.Tensor, weight: torch.Tensor, bias, state: torch.Tensor, positions: torch.Tensor, *,
                 limit: int) -> torch.Tensor:
    """A Mamba-2 mixer's causal depthwise convolution then SiLU: x (n, C) of state.shape[0] sequences, weight (C, K),
    bias (C,) or None, state (nseq, K-1, C) the inputs before each sequence, updated in place; a sequence starting
    at position 0 starts from zeros, one ending at `limit` (a parked row) leaves its state as it was (kernels/ssm.py)."""
    from kilnx.kernels import ssm
    return ssm.conv1d_silu_(x, weight, bias, state, positions, limit=limit)


def ssm_scan_(x, dt, B, C, A_log, dt_bias, D, state, positions, *, limit: int, dt_min: float = 0.0,
              dt_max: float = float("inf")) -> torch.Tensor:
    """Mamba-2's selective scan: x (n, H, P), dt (n, H), B / C (n, G, N), A_log / dt_bias / D (H,), state
    (nseq, H, P, N) fp32 updated in place (the position rules of conv1d_silu_) -> y (n, H, P) in x.dtype."""
    from kilnx.kernels import ssm
    return ssm.ssm_scan_(x, dt, B, C, A_log, dt_bias, D, state, positions, limit=limit, dt_min=dt_min, dt_max=dt_max)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """rms_norm of y * silu(z) over each group of `group` channels, times w: (n, I) in y.dtype."""
    from kilnx.kernels import ssm
    return ssm.gated_rms_norm(y, z, w, group, eps)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap)."""
    from kilnx.kernels import activations
    return activations.softcap(x, cap)


def scaled_add(x: torch.Tensor, residual: torch.Tensor, scale: float) -> torch.Tensor:
    """residual + scale * x (per-layer residual scaling)."""
    from kilnx.kernels import activations
    return activations.scaled_add(x, residual, scale)


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
          interleaved: bool = False) -> None:
    """Rotate q (T, Hq, D) and k (T, Hk, D) in place at integer positions (T,).

    inv_freq (R/2,) fp32 holds the per-pair frequencies (scaling such as llama3's already applied);
    R = 2 * len(inv_freq) <= D rotary dims, the rest pass through (partial rotary). neox layout pairs
    i with i + R/2; interleaved pairs 2i with 2i+1.
    """
    from kilnx.kernels import rope
    rope.rope_(q, k, positions, inv_freq, interleaved=interleaved)


def rope_and_cache_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    rows: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                    interleaved: bool = False) -> None:
    """rope_ on q (T, Hq, D) in place, and rotated k with v (T, Hk, D) written into the caches
    (B, Hk, S, D) at [rows[t], :, positions[t], :], in one kernel. q, k, v may be views of one qkv."""
    from kilnx.kernels import rope
    rope.rope_and_cache_(q, k, v, positions, rows, inv_freq, k_cache, v_cache, interleaved=interleaved)


def qmatmul(x, w) -> torch.Tensor:
    """x (..., K) @ w.T where w is a kilnx.quant.QWeight (N, K) or a dense (N, K) tensor -> (..., N).
    x may also be a PreparedX (from add_rms_norm_prepared / silu_mul_prepared) -> (M, N)."""
    from kilnx.kernels import qmatmul as qm
    from kilnx.kernels.prepared import PreparedX, qmatmul_prepared
    if isinstance(x, PreparedX):
        return qmatmul_prepared(x, w)
    return qm.qmatmul(x, w)


def prepared_format(parts, x: torch.Tensor):
    """(codes per word, group) when the GEMV that multiplies activations shaped like x by every weight
    in `parts` takes them prepared (see add_rms_norm_prepared); None when plain activations are needed."""
    from kilnx.kernels.prepared import prepared_format as fmt
    return fmt(parts, x)


def add_rms_norm_prepared(x, residual, w, eps: float, fmt, *, weight_offset: float = 0.0):
    """add_rms_norm whose normed output comes prepared (format `fmt` from prepared_format) for qmatmul:
    (h, PreparedX) in one launch, equal to preparing add_rms_norm's output."""
    from kilnx.kernels import prepared
    return prepared.add_rms_norm_prepared(x, residual, w, eps, fmt, weight_offset=weight_offset)


def silu_mul_prepared(gate_up: torch.Tensor, fmt):
    """silu_mul's result prepared (format `fmt` from prepared_format) for qmatmul, in one launch."""
    from kilnx.kernels import prepared
    return prepared.silu_mul_prepared(gate_up, fmt)


def swiglu_prepared(x, gate_up_parts: list, down_parts: list):
    """silu_mul(qmatmul(x, gate_up)) prepared for down's GEMV, in gate_up's GEMV launch (kernels/swiglu_prep.py):
    a PreparedX for x prepared (add_rms_norm_prepared) for a single [gate | up] weight, else None (the caller runs
    qmatmul and silu_mul_prepared). KILNX_FUSED_SWIGLU=0 turns it off (kernels/swiglu_prep.enabled: its A/Bs)."""
    from kilnx.kernels import swiglu_prep
    return swiglu_prep.swiglu_prepared(x, gate_up_parts, down_parts)


def fuses_qkv_rope(x, w, inv_freq: torch.Tensor, k_cache: torch.Tensor, num_heads: int) -> bool:
    """Whether qkv_rope_cache computes x @ w.T, the rotation and the cache write in one launch: x prepared
    for w's GEMV, one (Hq + 2 Hk) * D row weight, full rotary width (KILNX_FUSED_QKV_ROPE=0 turns it off)."""
    from kilnx.kernels import qkv_rope
    return qkv_rope.enabled() and qkv_rope.serves(x, w, inv_freq, k_cache, num_heads)


def qkv_rope_cache(x, w, positions: torch.Tensor, rows: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, *, num_heads: int, interleaved: bool = False) -> torch.Tensor:
    """qkv = qmatmul(x, w) split into q (M, Hq, D), k, v (M, Hk, D), then rope_and_cache_(q, k, v, positions,
    rows, inv_freq, k_cache, v_cache): returns the rotated q; k and v land in the caches. One launch
    where fuses_qkv_rope says so (ask it first), else refused."""
    from kilnx.kernels import qkv_rope
    return qkv_rope.qkv_rope_cache(x, w, positions, rows, inv_freq, k_cache, v_cache, num_heads=num_heads,
                                   interleaved=interleaved)


def qk_norm_rope_cache_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
                        k_norm: torch.Tensor, eps: float, positions: torch.Tensor, rows: torch.Tensor,
                        inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                        weight_offset: float = 0.0, interleaved: bool = False) -> None:
    """rms_norm(q, q_norm), rms_norm(k, k_norm) per head (qwen3, gemma3), then rope_and_cache_, in one launch:
    q (T, Hq, D) normalized and rotated in place, k normalized and rotated and v written to the caches at
    [rows[t], :, positions[t], :]. Full rotary width only (2 * len(inv_freq) = D); else refused."""
    from kilnx.kernels import qk_norm_rope
    qk_norm_rope.qk_norm_rope_cache_(q, k, v, q_norm, k_norm, eps, positions, rows, inv_freq, k_cache, v_cache,
                                     weight_offset=weight_offset, interleaved=interleaved)


def gather_qmatmul(x: torch.Tensor, w, expert_ids: torch.Tensor) -> torch.Tensor:
    """Per-(token, slot) expert matmul: x (T, K), w a QWeight expert stack (E, N, K), expert_ids
    (T, top_k) int -> (T, top_k, N), out[t, k] = x[t] @ w[expert_ids[t, k]].T; that is
    mx.gather_qmm(x[:, None, None, :], w, s, b, rhs_indices=expert_ids, transpose=True) squeezed.
    Leading dims of x / expert_ids beyond T are kept. Affine 2/4/8-bit weights."""
    from kilnx.kernels import moe as m
    return m.gather_qmatmul(x, w, expert_ids)


def moe(x: torch.Tensor, w_gate_up, w_down, expert_ids: torch.Tensor, routing_weights: torch.Tensor,
        activation: str = "silu") -> torch.Tensor:
    """Mixture-of-experts MLP: x (T, H); w_gate_up (E, 2F, H) laid out [gate | up]; w_down (E, H, F);
    expert_ids, routing_weights (T, top_k) -> (T, H) in x.dtype,
    y[t] = sum_k routing_weights[t, k] * down_e(act(gate_e x[t]) * up_e x[t]) with e = expert_ids[t, k].
    activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU); or "relu2" for experts without a gate (nemotron-3's):
    w_gate_up is then up alone (E, F, H) and each expert is down_e(relu(up_e x)²). Few tokens take per-slot
    GEMVs, more an align step and two grouped GEMMs (crossover: kilnx.kernels.moe.MOE_DECODE_MAX_TOKENS)."""
    from kilnx.kernels import moe as m
    return m.moe(x, w_gate_up, w_down, expert_ids, routing_weights, activation)


def moe_route(logits: torch.Tensor, top_k: int, normalize: bool, *, scoring: str = "softmax",
              bias: torch.Tensor | None = None, scale: float = 1.0):
    """An MoE router's choice: logits (T, E) -> (expert ids (T, top_k) int32, weights (T, top_k) fp32),
    the top_k of softmax(logits) (ties to the lower expert), divided by their sum when `normalize`.
    scoring="sigmoid" (DeepSeek-V3's, nemotron-3's): the experts of the top_k sigmoid(logits) + bias (E,),
    weighted by their sigmoid scores (divided by the scores' sum + 1e-20 when `normalize`) times `scale`."""
    from kilnx.kernels.moe_route import moe_route as route
    return route(logits, top_k, normalize, scoring=scoring, bias=bias, scale=scale)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
              scale: float, *, softcap: float | None = None, window: int | None = None, limit: int | None = None,
              prepared=None):
    """Causal attention of new queries over a KV cache.

    q (B, T, Hq, D); k_cache, v_cache (B, Hk, S, D) already holding the new keys at their positions;
    positions (B, T) int: query t of row b sees keys j <= positions[b, t] (and j > positions - window
    when a sliding window is given); a query at `limit` or past it (the cache's parking slot) is parked: it
    sees no key and its output is 0. Hq is a multiple of Hk (grouped-query). Returns (B, T, Hq, D), or
    with `prepared` (a format from prepared_format for the o projection) a PreparedX of (B*T, Hq*D).
    """
    from kilnx.kernels import attention as attn
    return attn.attention(q, k_cache, v_cache, positions, scale, softcap=softcap, window=window, limit=limit,
                          prepared=prepared)


def attention_new_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         rows: torch.Tensor, inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         scale: float, *, softcap: float | None = None, window: int | None = None,
                         limit: int | None = None, interleaved: bool = False, prepared=None):
    """The attention of a step's new tokens: `rope_and_cache_(q, k, v, positions.reshape(-1), rows, ...)`
    then `attention(q.view(B, T, Hq, D), k_cache, v_cache, positions, scale, ...)`, in as few launches
    as kilnx can. q (B*T, Hq, D), k and v (B*T, Hk, D) may be views of one qkv; positions (B, T)."""
    from kilnx.kernels import attention_decode
    return attention_decode.attention_new_tokens(q, k, v, positions, rows, inv_freq, k_cache, v_cache, scale,
                                                 softcap=softcap, window=window, limit=limit,
                                                 interleaved=interleaved, prepared=prepared)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of the largest value along the last axis (first on ties), int64."""
    from kilnx.kernels import activations
    return activations.argmax(logits)
