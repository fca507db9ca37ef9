"""Hybrid decoders: nemotron-h, a stack of Mamba-2, attention and MLP layers, each `x + mixer(rms_norm(x))`; and
granite 4.0 h, whose layers are a Mamba-2 or attention mixer then an MLP (dense SwiGLU, or routed experts beside a
shared one), each sublayer's output times residual_multiplier before its residual add.

A Mamba-2 layer projects x once into [z | x B C | dt]; x B C goes through a causal depthwise convolution and SiLU,
x is scanned with its heads' states (decay exp(-exp(A_log) * dt), input dt * x ⊗ B, output state · C + D * x), and
the result is normalized per group gated by silu(z) before the out projection (kernels/ssm.py). Attention without
positions (nemotron-h's; granite's "nope") runs the llama path's rope with zero frequencies, an exact identity;
nemotron-h's MLP layers are up -> relu² -> down without a gate; nemotron-3's MoE layers route each token to the top-k
of such experts by sigmoid scores (DeepSeek-V3's router) beside a shared one. Weights: models/hybrid_weights.py.

State is per cache row (runtime/kv_cache.py's HybridCache), so the engine runs a hybrid model only with each row's
tokens in order: see `recurrent`.
"""

from __future__ import annotations

import torch

from kilnx.kernels.sizes import NO_LIMIT
from kilnx.models.config import ModelConfig
from kilnx.models.hybrid_weights import FeedForward, MambaWeights, RoutedExperts
from kilnx.models.llama import LlamaModel, _linear
from kilnx.models.weights import ModelWeights


class HybridModel(LlamaModel):
    """forward(input_ids (B, T), positions (B, T), cache: HybridCache) -> logits, as LlamaModel's."""

    # The engine's contract for a model whose rows carry recurrent state: every token a forward runs into a row
    # must be that row's next one (no speculative tokens to take back), but for padding at the cache's last
    # position, which leaves the state as it was (kernels/ssm.py).
    recurrent = True

    def __init__(self, config: ModelConfig, weights: ModelWeights, *, ops=None):
        super().__init__(config, weights, ops=ops)
        if config.nope:   # attention without rotation: rope at zero frequency is the identity (cos 1, sin 0), exactly
            self._inv_freq = torch.zeros(config.head_dim // 2, device=self.device)
            self._inv_freq_local = self._inv_freq

    def new_cache(self, batch: int, max_seq: int, *, dtype, device, park: bool = False):
        from kilnx.runtime.kv_cache import HybridCache
        return HybridCache.for_hybrid(self.config, batch, max_seq, dtype=dtype, state_dtype=self.dtype, device=device,
                                      park=park)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, *,
                last: int | torch.Tensor | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        ops, w = self.ops, self.weights
        rows_flat = self._rows_of(B, T, positions.device)
        flat_pos = positions.reshape(-1)
        h = self._embed(input_ids)
        residual = None
        for i, layer in enumerate(w.layers):
            residual, x = self._residual_norm(h, residual, layer.norm)
            if layer.kind == "mamba":
                h = self._mamba(i, layer.mamba, x, flat_pos, cache)
            elif layer.kind == "attention":
                h = self._attention(i, layer, x, positions, rows_flat, cache, B, T)
            elif layer.kind == "moe":
                h = self._routed_experts(layer.moe, x)
            else:
                h = _linear(ops, ops.relu2(_linear(ops, x, layer.up)), [layer.down])
            if layer.ffn is not None:
                residual, x = self._residual_norm(h, residual, layer.ffn.norm)
                h = self._feed_forward(layer.ffn, x)
        return self._logits_of(self._residual_norm(h, residual, w.final_norm)[1].view(B, T, -1), last)

    __call__ = forward

    def _residual_norm(self, h, residual, norm):
        """(the residual stream with sublayer output h added, scaled by residual_multiplier; its rms_norm by `norm`):
        one launch where the multiplier is 1, the embedding's first norm where there is no residual yet."""
        ops, cfg = self.ops, self.config
        if residual is None:
            return h, ops.rms_norm(h, norm, cfg.rms_norm_eps)
        if cfg.residual_multiplier == 1.0:
            return ops.add_rms_norm(h, residual, norm, cfg.rms_norm_eps)
        residual = ops.scaled_add(h, residual, cfg.residual_multiplier)
        return residual, ops.rms_norm(residual, norm, cfg.rms_norm_eps)

    def _feed_forward(self, f: FeedForward, x):
        """granite's MLP: SwiGLU over [gate | up], plus in an MoE layer the top-k experts' SwiGLUs, weighted by the
        softmax over the chosen router logits."""
        ops, cfg = self.ops, self.config
        out = _linear(ops, ops.silu_mul(_linear(ops, x, f.gate_up)), [f.down])
        if f.router is None:
            return out
        ids, weights = ops.moe_route(_linear(ops, x, [f.router]), cfg.num_experts_per_tok, True)
        return ops.scaled_add(ops.moe(x, f.experts_gate_up, f.experts_down, ids, weights, "silu"), out, 1.0)

    def _routed_experts(self, e: RoutedExperts, x):
        """nemotron-3's MoE layer: the experts of the top-k sigmoid scores (their correction bias steering the choice),
        each down(relu²(up x)), weighted by the renormalized scores times routed_scaling_factor; plus the shared
        expert's down(relu²(up x))."""
        ops, cfg = self.ops, self.config
        # fp32 operands, as HF routes (the GPU's tile GEMM multiplies them as TF32: 10 mantissa bits, not bf16's 7)
        logits = _linear(ops, x.float(), [e.router])
        ids, weights = ops.moe_route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                     scoring="sigmoid", bias=e.router_bias, scale=cfg.routed_scaling_factor)
        shared = _linear(ops, ops.relu2(_linear(ops, x, e.shared_up)), [e.shared_down])
        return ops.scaled_add(ops.moe(x, e.up, e.down, ids, weights, "relu2"), shared, 1.0)

    def _mamba(self, i: int, m: MambaWeights, x, positions, cache):
        cfg, ops = self.config, self.ops
        n, I, C = x.shape[0], cfg.mamba_inner, cfg.conv_dim
        H, P, G, N = cfg.mamba_heads, cfg.mamba_head_dim, cfg.ssm_groups, cfg.ssm_state_size
        proj = _linear(ops, x, m.in_proj)
        limit = NO_LIMIT if cache.park is None else cache.park     # parked rows and padding (kernels/ssm.py)
        xbc = ops.conv1d_silu_(proj[:, I:I + C], m.conv_weight, m.conv_bias, cache.conv[i], positions, limit=limit)
        y = ops.ssm_scan_(xbc[:, :I].view(n, H, P), proj[:, I + C:], xbc[:, I:I + G * N].view(n, G, N),
                          xbc[:, I + G * N:].view(n, G, N), m.A_log, m.dt_bias, m.D, cache.ssm[i], positions,
                          limit=limit, dt_min=cfg.dt_limit[0], dt_max=cfg.dt_limit[1])
        y = ops.gated_rms_norm(y.view(n, I), proj[:, :I], m.norm, I // cfg.ssm_norm_groups, cfg.rms_norm_eps)
        return _linear(ops, y, [m.out_proj])

    def forward_mixed(self, *args, **kwargs):
        raise NotImplementedError("a hybrid model runs a prompt's chunk and a decode step as separate forwards "
                                  "(its rows' states advance token by token).")

