"""The public configs of the models kilnx targets, and the GEMM shapes each one asks of the tuner.

Numbers are those of the checkpoints' published config.json (instruct variants where eos differs).
"""

from __future__ import annotations

import math

from kilnx.models.config import ModelConfig, from_hf

_LLAMA3_EOS = (128001, 128008, 128009)

PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        arch="llama", name="HuggingFaceTB/SmolLM2-135M-Instruct", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_embeddings=True, max_position_embeddings=8192,
        bos_token_id=1, eos_token_ids=(2,)),
    "llama-3.2-1b": ModelConfig(
        arch="llama", name="meta-llama/Llama-3.2-1B-Instruct", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        rope_theta=500000.0, rope_scaling={"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        rms_norm_eps=1e-5, tie_embeddings=True, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=_LLAMA3_EOS),
    "llama-3.1-8b": ModelConfig(
        arch="llama", name="meta-llama/Llama-3.1-8B-Instruct", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rope_theta=500000.0, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        rms_norm_eps=1e-5, tie_embeddings=False, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=_LLAMA3_EOS),
    "qwen3-0.6b": ModelConfig(
        arch="qwen3", name="Qwen/Qwen3-0.6B", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_embeddings=True, qk_norm=True, max_position_embeddings=40960,
        bos_token_id=151643, eos_token_ids=(151645,)),
    "qwen3-8b": ModelConfig(
        arch="qwen3", name="Qwen/Qwen3-8B", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_embeddings=False, qk_norm=True, max_position_embeddings=40960,
        bos_token_id=151643, eos_token_ids=(151645,)),
    "qwen3-30b-a3b": ModelConfig(
        arch="qwen3_moe", name="Qwen/Qwen3-30B-A3B", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_embeddings=False, qk_norm=True,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,),
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    "mixtral-8x7b": ModelConfig(
        arch="mixtral", name="mistralai/Mixtral-8x7B-Instruct-v0.1", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rope_theta=1_000_000.0, rms_norm_eps=1e-5, tie_embeddings=False, max_position_embeddings=32768,
        bos_token_id=1, eos_token_ids=(2,), num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=14336, norm_topk_prob=True),
    "gemma-3-270m": ModelConfig(
        arch="gemma3", name="google/gemma-3-270m-it", vocab_size=262144, hidden_size=640,
        intermediate_size=2048, num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_embeddings=True, qk_norm=True,
        max_position_embeddings=32768, bos_token_id=2, eos_token_ids=(1, 106), hidden_act="gelu_tanh",
        norm_weight_offset=1.0, embed_scale=math.sqrt(640), query_pre_attn_scalar=256.0,
        sliding_window=512, layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(18)),
        rope_local_theta=10000.0),
    # nvidia/Nemotron-H-8B-Base-8K: 24 Mamba-2, 4 attention and 24 MLP layers
    "nemotron-h-8b": from_hf(dict(
        model_type="nemotron_h", _name_or_path="nvidia/Nemotron-H-8B-Base-8K", vocab_size=131072, hidden_size=4096,
        intermediate_size=21504, num_attention_heads=32, num_key_value_heads=8, head_dim=128, mamba_num_heads=128,
        mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, use_conv_bias=True, layer_norm_epsilon=1e-5,
        max_position_embeddings=8192, hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")),
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16: 23 Mamba-2, 23 MoE (128 relu² experts, top 6, sigmoid routing),
    # 6 attention layers
    "nemotron-3-nano-30b-a3b": from_hf(dict(
        model_type="nemotron_h", _name_or_path="nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", vocab_size=131072,
        hidden_size=2688, intermediate_size=1856, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, use_conv_bias=True,
        layer_norm_epsilon=1e-5, max_position_embeddings=262144, n_routed_experts=128, num_experts_per_tok=6,
        moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, n_shared_experts=1,
        routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True,
        hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME")),
}


def get_preset(name: str) -> ModelConfig:
    key = name.strip().lower()
    if key not in PRESETS:
        from kilnx.models.errors import ModelError
        raise ModelError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}.")
    return PRESETS[key]


def problems(cfg: ModelConfig) -> list[dict]:
    """GEMM shapes (N, K) of every distinct linear of `cfg`, as fused by the model, for the tuner.

    Each entry: {"name", "N", "K", "count"} where count is how many times per token the GEMM runs
    (layers, or layers x active experts for MoE). The tuner sweeps M (tokens) itself.
    """
    if cfg.is_hybrid:
        return _hybrid_problems(cfg)
    L = cfg.num_layers
    out = [
        {"name": "qkv", "N": cfg.q_size + 2 * cfg.kv_size, "K": cfg.hidden_size, "count": L},
        {"name": "o", "N": cfg.hidden_size, "K": cfg.q_size, "count": L},
    ]
    if cfg.is_moe:
        F = cfg.moe_intermediate_size
        act = L * cfg.num_experts_per_tok
        out += [
            {"name": "router", "N": cfg.num_experts, "K": cfg.hidden_size, "count": L},
            {"name": "expert_gate_up", "N": 2 * F, "K": cfg.hidden_size, "count": act},
            {"name": "expert_down", "N": cfg.hidden_size, "K": F, "count": act},
        ]
    else:
        F = cfg.intermediate_size
        out += [
            {"name": "gate_up", "N": 2 * F, "K": cfg.hidden_size, "count": L},
            {"name": "down", "N": cfg.hidden_size, "K": F, "count": L},
        ]
    out.append({"name": "lm_head", "N": cfg.vocab_size, "K": cfg.hidden_size, "count": 1})
    return out


def _hybrid_problems(cfg: ModelConfig) -> list[dict]:
    count = {k: cfg.layer_kinds.count(k) for k in ("mamba", "attention", "mlp", "moe")}
    H, I, F = cfg.hidden_size, cfg.mamba_inner, cfg.intermediate_size
    out = [{"name": "in_proj", "N": I + cfg.conv_dim + cfg.mamba_heads, "K": H, "count": count["mamba"]},
           {"name": "out_proj", "N": H, "K": I, "count": count["mamba"]},
           {"name": "qkv", "N": cfg.q_size + 2 * cfg.kv_size, "K": H, "count": count["attention"]},
           {"name": "o", "N": H, "K": cfg.q_size, "count": count["attention"]},
           {"name": "up", "N": F, "K": H, "count": count["mlp"]},
           {"name": "down", "N": H, "K": F, "count": count["mlp"]},
           {"name": "lm_head", "N": cfg.vocab_size, "K": H, "count": 1}]
    if count["moe"]:      # nemotron-3: the router, the shared relu² expert (the routed ones: kernels/moe_specs.py)
        S, E = cfg.shared_intermediate_size, cfg.num_experts
        out += [{"name": "router", "N": E, "K": H, "count": count["moe"]},
                {"name": "shared_up", "N": S, "K": H, "count": count["moe"]},
                {"name": "shared_down", "N": H, "K": S, "count": count["moe"]}]
    return [p for p in out if p["count"]]
