"""HF transformers as a bench peer: the same checkpoint, prompts and timing protocol as `run_bench`.

`kilnx bench --peer hf` times transformers' eager model (weights dequantized to fp32 at load, as
transformers does for GGUF) in the same process, with the same torch thread count, so the two
decode rates in one CSV are comparable. Prompts are drawn from the same seeded generator in the same
order as run_bench draws them.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from kilnx.runtime.bench import BenchRow, copy_bandwidth_gbps


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
    bw = bandwidth_gbps or copy_bandwidth_gbps(torch.device("cpu"))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_tok = 2 * cfg.num_hidden_layers * heads * head_dim * 4
    g = torch.Generator().manual_seed(seed)
    # the same draws as run_bench: a warm-up prompt, then one prompt per length
    warm = torch.randint(0, vocab_size, (min(16, max(prompt_lens)),), generator=g).tolist()
    _greedy(model, warm, min(4, gen))
    rows, stamp = [], time.strftime("%Y-%m-%dT%H:%M:%S")
    for L in prompt_lens:
        ids = torch.randint(0, vocab_size, (L,), generator=g).tolist()
        runs = [_greedy(model, ids, gen) for _ in range(max(1, repeats))]   # medians, as run_bench's
        ttft, decode = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        per_token = weight_bytes + int(kv_per_tok * (L + gen / 2))
        rows.append(BenchRow(
            model=model_name, device="cpu", ops="hf-transformers", weights=weights, prompt_len=L, gen=gen,
            ttft_ms=ttft * 1e3, prefill_tok_s=L / ttft, decode_tok_s=decode, weight_bytes=weight_bytes,
            kv_bytes_per_token=kv_per_tok, bytes_per_decode_token=per_token, copy_bandwidth_gbps=bw,
            roofline_pct=100.0 * decode / (bw * 1e9 / per_token), timestamp=stamp))
    return rows
