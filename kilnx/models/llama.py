"""The llama-family decoder: llama 3.x, SmolLM2, mistral, qwen2 (qkv bias), qwen3 (q/k norms), gemma3,
qwen3-moe and mixtral (routed expert MLPs).

Every piece of arithmetic goes through the ops module the model was built with (kilnx.ops or the
torch-eager peer), so the same forward runs on the tuned kernels and on the reference. What stays
in torch here is data movement only: embedding gather, views, concatenation.
"""

from __future__ import annotations

import torch

from kilnx.models.backend import resolve_ops
from kilnx.models.config import ModelConfig
from kilnx.models.weights import LayerWeights, ModelWeights


class LlamaModel:
    """forward(input_ids (B, T), positions (B, T), kv_cache) -> logits (B, T, V) (or (B, 1, V))."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, *, ops=None):
        config.check_supported()
        self.config = config
        self.weights = weights
        self.ops = resolve_ops(ops)
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        gemma = config.arch == "gemma3"
        self._gemma = gemma
        self._norm_offset = config.norm_weight_offset
        # Rotary frequencies live on the device once; gemma3's sliding layers use their own base.
        inv = config.inv_freq()
        if weights.rope_freq_factors is not None:
            inv = inv / weights.rope_freq_factors.float().cpu()
        self._inv_freq = inv.to(self.device)
        self._inv_freq_local = (config.inv_freq(local=True).to(self.device)
                                if config.rope_local_theta is not None else self._inv_freq)
        self._rows: dict = {}

    # ------------------------------------------------------------------ public
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, *,
                last: int | torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V), or (B, 1, V) of token `last` alone: an index (-1, the last token) or a (1,) device
        tensor, read when a captured graph replays (a prompt padded to a prefill graph's length, runtime/
        engine.py)."""
        B, T = input_ids.shape
        rows_flat = self._rows_of(B, T, positions.device)      # cache row of each token
        x = self._layers(input_ids, lambda i, layer, x: self._attention(i, layer, x, positions, rows_flat, kv_cache,
                                                                        B, T))
        return self._logits_of(x.view(B, T, -1), last)

    __call__ = forward

    def _logits_of(self, x: torch.Tensor, last) -> torch.Tensor:
        """Logits of the final hidden states x (B, T, H): every token's, or token `last`'s (forward's argument)."""
        if isinstance(last, torch.Tensor):
            x = x.index_select(1, last)
        elif last is not None:
            x = x.narrow(1, last % x.shape[1], 1).contiguous()
        return self._logits(x)

    def forward_mixed(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, kv_cache,
                      segments: list[tuple[int, int, int, int]], picks: torch.Tensor) -> torch.Tensor:
        """Tokens of several kinds in one forward: ids, positions, rows (N,) flat, `segments` (start, row0, B, T)
        cutting them into the (B, T) blocks attention runs over (cache rows row0..row0+B-1), e.g. a prompt's
        chunk (one row, T tokens) and a decode step (rows 0..B-1, one token each). The linear layers read each
        weight once for all N tokens; attention runs per segment. Logits (len(picks), V) of the tokens `picks`."""
        x = self._layers(ids[None], lambda i, layer, x: self._attention_segments(i, layer, x, positions, rows,
                                                                                 kv_cache, segments))
        return self._logits(x.index_select(0, picks))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = _linear(self.ops, x, self.weights.lm_head)
        if self.config.final_logit_softcap:
            logits = self.ops.softcap(logits, self.config.final_logit_softcap)
        return logits

    def _layers(self, input_ids: torch.Tensor, attend) -> torch.Tensor:
        """The decoder stack over input_ids' tokens, `attend(i, layer, x)` giving layer i's attention output:
        the final-normed hidden states (tokens, H)."""
        cfg, ops, w = self.config, self.ops, self.weights
        eps, off = cfg.rms_norm_eps, self._norm_offset
        h = self._embed(input_ids)
        residual = None
        for i, layer in enumerate(w.layers):
            if residual is None:
                residual = h
                x = ops.rms_norm(h, layer.attn_norm, eps, weight_offset=off)
            else:
                residual, x = self._add_norm(h, residual, layer.attn_norm, layer.qkv)
            a = attend(i, layer, x)
            if self._gemma:
                a = ops.rms_norm(a, layer.post_attn_norm, eps, weight_offset=off)
            mlp_in = layer.gate_up if layer.router is None else [layer.router, layer.experts_gate_up]
            residual, x = self._add_norm(a, residual, layer.mlp_norm, mlp_in)
            h = self._mlp(layer, x)
            if self._gemma:
                h = ops.rms_norm(h, layer.post_mlp_norm, eps, weight_offset=off)
        return ops.add_rms_norm(h, residual, w.final_norm, eps, weight_offset=off)[1]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of input_ids' tokens, (tokens, H)."""
        emb = getattr(self.ops, "embedding", None)
        return emb(self.weights.embed, input_ids) if emb is not None else self.weights.embed[input_ids.reshape(-1)]

    def _rows_of(self, B: int, T: int, device) -> torch.Tensor:
        """The cache row of each token, made once per (B, T): a step then runs no torch op that writes
        data outside the kernels, which the CPU engine's step replay relies on (runtime/engine.py)."""
        key = (B, T, device)
        got = self._rows.get(key)
        if got is None:
            if len(self._rows) >= 64:   # prefill chunk lengths vary: keep the memo small
                self._rows.clear()
            got = self._rows[key] = torch.arange(B, device=device).repeat_interleave(T)
        return got

    # ------------------------------------------------------------------ blocks
    def _prepared_format(self, parts, x):
        """The format in which the GEMV of `parts` takes x prepared, or None (plain x): producers then
        emit prepared activations in the same launch (kernels/prepared.py). An MoE layer's MLP asks for
        its router and its experts' gate_up together: both read the same x."""
        ask = getattr(self.ops, "prepared_format", None)
        return ask(parts, x) if ask is not None and parts else None

    def _add_norm(self, x, residual, norm, parts):
        """(residual, normed x) for the linear layer `parts`, prepared for its GEMV where it takes that."""
        cfg, ops = self.config, self.ops
        fmt = self._prepared_format(parts, x)
        if fmt is not None:
            return ops.add_rms_norm_prepared(x, residual, norm, cfg.rms_norm_eps, fmt,
                                             weight_offset=self._norm_offset)
        return ops.add_rms_norm(x, residual, norm, cfg.rms_norm_eps, weight_offset=self._norm_offset)

    def _rotary(self, i: int):
        """(inverse frequencies, attention window) of layer i: gemma's sliding layers have their own rope base."""
        if self.config.layer_is_sliding(i):
            return self._inv_freq_local, self.config.sliding_window
        return self._inv_freq, None

    def _qkv(self, layer: LayerWeights, x):
        """x projected: qkv (n, q + 2kv), qwen2's bias added, and its q (n, Hq, D), k, v (n, Hk, D) views."""
        cfg = self.config
        qkv = _linear(self.ops, x, layer.qkv)
        if layer.qkv_bias is not None:
            # qwen2's bias add: the ops contract has no bias epilogue, and this is one tiny elementwise op.
            qkv = qkv + layer.qkv_bias
        n, qs, ks = qkv.shape[0], cfg.q_size, cfg.kv_size
        return (qkv, qkv[:, :qs].view(n, cfg.num_heads, cfg.head_dim),
                qkv[:, qs:qs + ks].view(n, cfg.num_kv_heads, cfg.head_dim),
                qkv[:, qs + ks:].view(n, cfg.num_kv_heads, cfg.head_dim))

    def _attention(self, i: int, layer: LayerWeights, x, positions, rows_flat, cache, B: int, T: int):
        cfg, ops = self.config, self.ops
        Hq, D, qs = cfg.num_heads, cfg.head_dim, cfg.q_size
        inv, window = self._rotary(i)
        k_cache, v_cache = cache.k[i], cache.v[i]
        fuses = getattr(ops, "fuses_qkv_rope", None)
        if (fuses is not None and layer.qkv_bias is None and layer.q_norm is None and len(layer.qkv) == 1
                and fuses(x, layer.qkv[0], inv, k_cache, Hq)):
            # the projection rotates q and writes k, v into the caches itself (kernels/qkv_rope.py)
            q = ops.qkv_rope_cache(x, layer.qkv[0], positions.reshape(-1), rows_flat, inv, k_cache, v_cache,
                                   num_heads=Hq, interleaved=cfg.rope_interleaved)
            fmt = self._prepared_format([layer.o], q.view(B * T, qs))
            o = ops.attention(q.view(B, T, Hq, D), k_cache, v_cache, positions, cfg.attn_scale,
                              softcap=cfg.attn_logit_softcap, window=window, limit=cache.park, prepared=fmt)
        else:
            qkv, q, k, v = self._qkv(layer, x)
            fmt = self._prepared_format([layer.o], qkv[:, :qs])     # (B*T, Hq*D), as o's input
            qk_fused = getattr(ops, "qk_norm_rope_cache_", None)
            if layer.q_norm is not None and qk_fused is not None and 2 * inv.shape[0] == D:
                # q/k norms, rope and the cache write in one launch (kernels/qk_norm_rope.py)
                qk_fused(q, k, v, layer.q_norm, layer.k_norm, cfg.rms_norm_eps, positions.reshape(-1), rows_flat,
                         inv, k_cache, v_cache, weight_offset=self._norm_offset, interleaved=cfg.rope_interleaved)
                o = ops.attention(q.view(B, T, Hq, D), k_cache, v_cache, positions, cfg.attn_scale,
                                  softcap=cfg.attn_logit_softcap, window=window, limit=cache.park, prepared=fmt)
                return _linear(ops, o if fmt is not None else o.reshape(B * T, Hq * D), [layer.o])
            if layer.q_norm is not None:
                q = ops.rms_norm(q, layer.q_norm, cfg.rms_norm_eps, weight_offset=self._norm_offset)
                k = ops.rms_norm(k, layer.k_norm, cfg.rms_norm_eps, weight_offset=self._norm_offset)
            # rotary embedding, the cache write and attention, in as few launches as the ops can
            o = ops.attention_new_tokens(q, k, v, positions, rows_flat, inv, k_cache, v_cache, cfg.attn_scale,
                                         softcap=cfg.attn_logit_softcap, window=window, limit=cache.park,
                                         interleaved=cfg.rope_interleaved, prepared=fmt)
        return _linear(ops, o if fmt is not None else o.reshape(B * T, Hq * D), [layer.o])

    def _attention_segments(self, i: int, layer: LayerWeights, x, positions, rows, cache, segments):
        """_attention for forward_mixed: every token's rotation and cache write in one launch (per-token rows
        and positions), then attention per segment over its rows of the cache."""
        cfg, ops = self.config, self.ops
        Hq, D = cfg.num_heads, cfg.head_dim
        inv, window = self._rotary(i)
        k_cache, v_cache = cache.k[i], cache.v[i]
        _, q, k, v = self._qkv(layer, x)
        if layer.q_norm is not None:
            q = ops.rms_norm(q, layer.q_norm, cfg.rms_norm_eps, weight_offset=self._norm_offset)
            k = ops.rms_norm(k, layer.k_norm, cfg.rms_norm_eps, weight_offset=self._norm_offset)
        ops.rope_and_cache_(q, k, v, positions, rows, inv, k_cache, v_cache, interleaved=cfg.rope_interleaved)
        outs = []
        for start, row0, B, T in segments:
            outs.append(ops.attention(q[start:start + B * T].view(B, T, Hq, D), k_cache[row0:row0 + B],
                                      v_cache[row0:row0 + B], positions[start:start + B * T].view(B, T),
                                      cfg.attn_scale, softcap=cfg.attn_logit_softcap, window=window,
                                      limit=cache.park).reshape(B * T, Hq * D))
        return _linear(ops, torch.cat(outs) if len(outs) > 1 else outs[0], [layer.o])

    def _mlp(self, layer: LayerWeights, x):
        ops = self.ops
        if layer.router is not None:
            # MoE: the router's top-k experts per token, then their SwiGLU MLPs weighted and summed
            cfg = self.config
            ids, weights = ops.moe_route(_linear(ops, x, [layer.router]), cfg.num_experts_per_tok,
                                         cfg.norm_topk_prob)
            return ops.moe(x, layer.experts_gate_up, layer.experts_down, ids, weights, cfg.hidden_act)
        fused = getattr(ops, "swiglu_prepared", None)
        if fused is not None and self.config.hidden_act != "gelu_tanh":
            h = fused(x, layer.gate_up, [layer.down])          # gate_up's GEMV, SwiGLU and down's prep in one launch
            if h is not None:
                return _linear(ops, h, [layer.down])
        gate_up = _linear(ops, x, layer.gate_up)               # (B*T, 2F) laid out [gate | up]
        if self.config.hidden_act == "gelu_tanh":
            act = ops.gelu_tanh_mul(gate_up)
        else:
            fmt = self._prepared_format([layer.down], gate_up[..., :gate_up.shape[-1] // 2])
            act = ops.silu_mul_prepared(gate_up, fmt) if fmt is not None else ops.silu_mul(gate_up)
        return _linear(ops, act, [layer.down])


def _linear(ops, x: torch.Tensor, parts: list) -> torch.Tensor:
    if len(parts) == 1:
        return ops.qmatmul(x, parts[0])
    # Parts kept apart because their storage formats differ (e.g. GGUF Q4_K q with Q6_K v).
    return torch.cat([ops.qmatmul(x, p) for p in parts], dim=-1)
