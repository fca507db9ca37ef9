"""Tiny random-weight configs of each supported architecture, for fast structural tests."""

from __future__ import annotations

import math

import torch

from kilnx.models.config import ModelConfig

TINY = {
    "llama": ModelConfig(arch="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                         tie_embeddings=False, max_position_embeddings=64, bos_token_id=1, eos_token_ids=(2,)),
    "qwen3": ModelConfig(arch="qwen3", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=1, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_embeddings=True, qk_norm=True, max_position_embeddings=64, eos_token_ids=(2,)),
    "qwen2": ModelConfig(arch="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_embeddings=True, attention_bias=True, max_position_embeddings=64),
    "gemma3": ModelConfig(arch="gemma3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3,
                          num_heads=2, num_kv_heads=1, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6,
                          tie_embeddings=True, qk_norm=True, max_position_embeddings=64, hidden_act="gelu_tanh",
                          norm_weight_offset=1.0, embed_scale=math.sqrt(64), query_pre_attn_scalar=32.0,
                          sliding_window=4, layer_types=("sliding", "sliding", "full"), rope_local_theta=10000.0),
    # every token takes all 4 experts: the output is continuous in the router's logits, so kilnx and a peer
    # agree to rounding (a top-k of fewer could pick other experts at near-ties); layer 0 stays dense.
    # Experts run as 4-bit stacks only, so this model is always built 4-bit (reduction dims of 128).
    "qwen3_moe": ModelConfig(arch="qwen3_moe", vocab_size=256, hidden_size=128, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=1, head_dim=32, rope_theta=1e6,
                             rms_norm_eps=1e-6, tie_embeddings=False, qk_norm=True, max_position_embeddings=64,
                             eos_token_ids=(2,), num_experts=4, num_experts_per_tok=4, moe_intermediate_size=128,
                             norm_topk_prob=True, mlp_only_layers=(0,)),
}


def tiny_model(arch: str, ops="torch", seed: int = 0, fmt: str = "bf16", device: str = "cpu"):
    from kilnx.models.llama import LlamaModel
    from kilnx.models.loaders.random_init import RandomSource
    from kilnx.models.weights import build_weights
    cfg = TINY[arch]
    src = RandomSource(cfg, fmt="q4" if cfg.is_moe else fmt, dtype=torch.float32, seed=seed)
    return LlamaModel(cfg, build_weights(cfg, src, dtype=torch.float32, device=device), ops=ops)


class WrongGuesses:
    """A speculative proposer whose guesses the tiny models' greedy output never takes (token 255): what rounds of
    wrong guesses cost (runtime/speculative.py Pacing)."""
    num_draft = 2

    def begin(self, engine=None):
        pass

    def fork(self):
        return WrongGuesses()

    def propose(self, tokens, k):
        return [255] * k
