"""MLX-format checkpoints written by mlx-lm itself (random tiny llama / qwen3 / qwen3-moe / mixtral, dense
and 4-bit with a per-layer override): kilnx's logits equal mlx-lm's on the same directory. A dense MoE
checkpoint is refused (its experts must be quantized stacks) with the way out."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

BASE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=320, rms_norm_eps=1e-5, max_position_embeddings=128,
            bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama": dict(BASE, model_type="llama", rope_theta=10000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen3": dict(BASE, model_type="qwen3", rope_theta=1e6, tie_word_embeddings=True, num_key_value_heads=1),
    # 8 experts, top-3 renormalized; layer 0 keeps a dense MLP (mlp_only_layers), layer 1 is routed
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", rope_theta=1e6, tie_word_embeddings=False, num_experts=8,
                      num_experts_per_tok=3, moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[0],
                      norm_topk_prob=True),
    # mixtral: every layer routed, top-2 of 4 (softmax over the chosen logits)
    "mixtral": dict(BASE, model_type="mixtral", rope_theta=1e6, num_local_experts=4, num_experts_per_tok=2),
}
IDS = [3, 17, 99, 250, 5, 61, 7, 128, 300, 42, 11]


def _write_mlx_checkpoint(path, config: dict, quant: str | None, seed: int = 0):
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import quantize_model, save_config, save_model
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    params = {}
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            params[name] = 1.0 + 0.1 * mx.random.normal(p.shape)      # norms away from 1 catch mix-ups
        else:
            params[name] = mx.random.normal(p.shape) * (p.shape[-1] ** -0.5 if p.ndim == 2 else 0.02)
    params["model.embed_tokens.weight"] = mx.random.normal((config["vocab_size"], config["hidden_size"]))
    model.update(tree_unflatten(list(params.items())))
    if quant == "q4":
        # 4-bit groups of 64 everywhere, but 8-bit groups of 32 for down_proj: exercises per-layer overrides.
        def predicate(path, module):
            return {"group_size": 32, "bits": 8, "mode": "affine"} if "down_proj" in path else True
        model, config = quantize_model(model, dict(config), group_size=64, bits=4, quant_predicate=predicate)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    logits = model(mx.array([IDS]))
    return np.array(logits.astype(mx.float32))[0]


@pytest.mark.parametrize("quant", [None, "q4"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_logits_match_mlx_lm(tmp_path, arch, quant, backend):
    from kilnx.models.loaders import load_model
    from kilnx.runtime.kv_cache import KVCache
    want = _write_mlx_checkpoint(tmp_path, dict(CONFIGS[arch]), quant)
    if arch in ("qwen3_moe", "mixtral") and not quant:
        from kilnx.models.errors import CheckpointError
        with pytest.raises(CheckpointError, match="not quantized .* stacks"):
            load_model(str(tmp_path), device=backend.device, dtype=torch.float32, ops=backend.ops)
        return
    lm = load_model(str(tmp_path), device=backend.device, dtype=torch.float32, ops=backend.ops)
    if quant:
        from kilnx.quant import QWeight
        assert isinstance(lm.model.weights.layers[0].qkv[0], QWeight)   # stayed quantized
        layer = lm.model.weights.layers[0]
        assert (layer.down or layer.experts_down).bits == 8
    if arch == "qwen3_moe":
        layer = lm.model.weights.layers[1]
        assert layer.down is None and layer.experts_gate_up.shape == (8, 128, 128) and layer.experts_down.bits == 8
    if arch == "mixtral":
        assert all(layer.experts_gate_up.shape == (4, 512, 128) for layer in lm.model.weights.layers)
    dev = backend.device
    cache = KVCache.for_model(lm.config, 1, 32, device=dev)
    with torch.no_grad():
        got = lm.model.forward(torch.tensor([IDS], device=dev), torch.arange(len(IDS), device=dev)[None],
                               cache)[0].cpu().numpy()
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()
