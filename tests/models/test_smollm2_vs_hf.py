"""Truth on real weights: kilnx's greedy SmolLM2-135M output equals HF transformers' on the same GGUF."""

from __future__ import annotations

import os

import pytest
import torch

PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Paris is the capital of"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def hf(smollm2_path):
    transformers = pytest.importorskip("transformers")
    d, name = os.path.split(smollm2_path)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    return tok, model


@pytest.fixture(scope="module")
def hf_greedy(hf):
    tok, model = hf
    out = {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
            out[p] = (ids[0].tolist(), gen[0, ids.shape[1]:].tolist())
    return out


_models = {}


def _kilnx(backend, path):
    if backend not in _models:
        from kilnx.models.loaders import load_model
        _models[backend] = load_model(path, device=backend.device, dtype=torch.float32, ops=backend.ops)
    return _models[backend]


def greedy(lm, ids: list[int], n: int) -> list[int]:
    from kilnx.runtime.kv_cache import KVCache
    dev = lm.model.device
    cache = KVCache.for_model(lm.config, 1, len(ids) + n, device=dev)
    x = torch.tensor([ids], device=dev)
    pos = torch.arange(len(ids), device=dev)[None]
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = lm.model.forward(x, pos, cache, last=-1)
            nxt = int(lm.model.ops.argmax(logits[0, -1]))
            out.append(nxt)
            x = torch.tensor([[nxt]], device=dev)
            pos = pos[:, -1:] + 1
    return out


def test_tokenizer_matches_hf(hf, smollm2_path):
    from kilnx.models.loaders import open_source
    tok_hf = hf[0]
    _, _, tok = open_source(smollm2_path)
    for text in PROMPTS + ["Héllo wörld 😀 日本語\n\n\tx = [1, 2]  # done", "<|im_start|>user\nHi<|im_end|>"]:
        assert tok.encode(text) == tok_hf(text).input_ids, text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_hf(backend, smollm2_path, hf_greedy, prompt):
    lm = _kilnx(backend, smollm2_path)
    ids, want = hf_greedy[prompt]
    assert lm.tokenizer.encode(prompt) == ids
    assert greedy(lm, ids, NEW_TOKENS) == want
