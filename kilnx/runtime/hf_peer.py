"""HF transformers as a bench peer: the same checkpoint, prompts and timing protocol as `run_bench`.

`kilnx bench --peer hf` times transformers' eager model (weights dequantized to fp32 at load, as
transformers does for GGUF) in the same process, with the same torch thread count, so the two
decode rates in one CSV are comparable; bench.timed_rows times it as it times kilnx.
"""

from __future__ import annotations

import os
import time

import torch

from kilnx.runtime.bench import BenchRow, copy_bandwidth_gbps, timed_rows


def load_hf_model(source: str):
    """transformers' causal LM for a GGUF file or a safetensors directory, fp32 on the CPU."""
    import transformers
    if os.path.isfile(source):
        d, name = os.path.split(source)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def _greedy(model, ids: list[int], gen: int) -> tuple[float, float]:
    """(TTFT seconds, decode tok/s) of greedy generation of `gen` tokens, counted as generate.py does:
    decode tok/s covers the tokens after the first over the time after the first."""
    t0 = time.perf_counter()
    out = model(torch.tensor([ids]), use_cache=True)
    tok = out.logits[0, -1].argmax()
    ttft = time.perf_counter() - t0
    start = time.perf_counter()
    for _ in range(gen - 1):
        out = _step(model, tok, out)
        tok = out.logits[0, -1].argmax()
    end = time.perf_counter()
    return ttft, (gen - 1) / (end - start) if gen > 1 else 0.0


def _step(model, tok, out):
    """One decode step on the previous output's KV cache (`cache` since transformers 5)."""
    if "cache" in out:
        return model(tok.view(1, 1), cache=out["cache"], use_cache=True)
    return model(tok.view(1, 1), past_key_values=out.past_key_values, use_cache=True)


def run_hf_bench(source: str, *, vocab_size: int, prompt_lens: list[int], gen: int, model_name: str,
                 weights: str, bandwidth_gbps: float | None = None, seed: int = 0,
                 repeats: int = 1) -> list[BenchRow]:
    model = load_hf_model(source)
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return timed_rows(lambda ids, n: _greedy(model, ids, n), vocab_size=vocab_size, prompt_lens=prompt_lens,
                      gen=gen, seed=seed, repeats=repeats, model=model_name, device="cpu", ops="hf-transformers",
                      weights=weights, weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                      kv_bytes_per_token=2 * cfg.num_hidden_layers * heads * head_dim * 4,
                      bandwidth_gbps=bandwidth_gbps or copy_bandwidth_gbps(torch.device("cpu")))
