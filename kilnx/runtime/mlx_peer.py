"""mlx-lm as a bench peer: the same preset, 4-bit groups of 64 as `--random` builds, same prompts and timing.

`kilnx bench --random --peer mlx` builds the preset in mlx-lm (random weights, `nn.quantize` to 4-bit
gs64, the format kilnx's `--random` weights have) and times mlx-lm's own generation loop
(`generate_step`) in the same process: TTFT to the first token, decode tok/s over the tokens after it,
counted as generate.py counts, by bench.timed_rows as kilnx is timed. mlx runs on its default device
(the CPU with `mlx[cpu]`; CUDA with mlx's CUDA wheels), so the CSV row's device says which.
"""

from __future__ import annotations

import importlib
import time

from kilnx.runtime.bench import BenchRow, timed_rows

# kilnx architectures mlx-lm builds from a config (llama family; others: no peer)
_MLX_MODULE = {"llama": "llama", "qwen3": "qwen3", "qwen2": "qwen2"}


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (not installed, or no mlx-lm model for the architecture)."""


def mlx_config(cfg) -> dict:
    """mlx-lm's config dict for a kilnx ModelConfig (llama-family fields)."""
    if cfg.arch not in _MLX_MODULE or cfg.is_moe:
        raise PeerUnavailable(f"--peer mlx: no mlx-lm model for architecture {cfg.arch!r} "
                              f"(it serves {', '.join(sorted(_MLX_MODULE))}, dense).")
    d = dict(model_type=_MLX_MODULE[cfg.arch], hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
             intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_heads,
             num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
             rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
             max_position_embeddings=cfg.max_position_embeddings)
    if cfg.rope_scaling:
        rs = dict(cfg.rope_scaling)
        rs["rope_type"] = rs.pop("type", rs.get("rope_type"))
        d["rope_scaling"] = rs
    return d


def build_mlx_model(cfg, seed: int = 0):
    """The preset in mlx-lm with random weights, quantized to 4-bit groups of 64."""
    config = mlx_config(cfg)
    try:
        import mlx.core as mx
        import mlx.nn as nn
        module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    except ImportError as e:
        raise PeerUnavailable(f"--peer mlx needs mlx and mlx-lm ({e}); install them with "
                              "`pip install 'kilnx[mlx]'`.") from e
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def _greedy(model, ids: list[int], gen: int) -> tuple[float, float]:
    """(TTFT seconds, decode tok/s) of mlx-lm's greedy generation of `gen` tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    t0 = time.perf_counter()
    steps = generate_step(mx.array(ids), model, max_tokens=gen)
    tok, _ = next(steps)
    int(tok)                                   # materialised: the first token exists
    ttft = time.perf_counter() - t0
    start = time.perf_counter()
    n = 0
    for tok, _ in steps:
        int(tok)
        n += 1
    end = time.perf_counter()
    return ttft, n / (end - start) if n else 0.0


def run_mlx_bench(cfg, *, prompt_lens: list[int], gen: int, model_name: str, bandwidth_gbps: float,
                  seed: int = 0, repeats: int = 1) -> list[BenchRow]:
    model = build_mlx_model(cfg, seed)
    import mlx.core as mx
    from mlx.utils import tree_flatten
    return timed_rows(lambda ids, n: _greedy(model, ids, n), vocab_size=cfg.vocab_size, prompt_lens=prompt_lens,
                      gen=gen, seed=seed, repeats=repeats, model=model_name, device=f"mlx:{mx.default_device()}",
                      ops="mlx-lm", weights="random-q4",
                      weight_bytes=sum(p.nbytes for _, p in tree_flatten(model.parameters())),
                      # mlx-lm's cache holds keys and values in the model's 16-bit dtype
                      kv_bytes_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2,
                      bandwidth_gbps=bandwidth_gbps)
