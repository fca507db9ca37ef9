"""--kv-cache-dtype fp8: the engine's cache holds K and V as fp8 e4m3 (a quarter of the CPU's fp32 cache, half of
a GPU's bf16 one), and on the bundled SmolLM2-135M greedy decoding says what it says with the full-width cache.
A name that is not a cache dtype is one clear error."""

from __future__ import annotations

import pytest
import torch

from kilnx.runtime.engine import Engine

PROMPTS = ["The three primary colors are red, yellow and blue. In painting, mixing them gives",
           "def fibonacci(n):", "Paris is the capital of"]


def greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    tokens = [int(engine.prefill(ids).argmax())]
    for pos in range(len(ids), len(ids) + n - 1):
        tokens.append(int(engine.decode(torch.tensor([tokens[-1]]), torch.tensor([pos])).reshape(-1).argmax()))
    return tokens


def test_an_fp8_cache_is_a_quarter_of_the_cpus_and_keeps_smollm2s_choices(smollm2_path, monkeypatch):
    """Teacher-forced on the full cache's greedy tokens (32 steps a prompt): the fp8 cache's logits pick the same
    token at >= 90% of the steps (measured: 94 of 96) and stay within 15% of the largest logit (measured: 10.7%,
    5% on average: e4m3 keeps 3 mantissa bits). Free-running, the text agrees until a near tie flips."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")           # numba kernels, as the CLI on a CPU runs them
    from kilnx.models.loaders import load_model
    lm = load_model(smollm2_path, device="cpu")
    agree, steps = 0, 0
    for prompt in PROMPTS:
        full = Engine(lm.model, max_seq=96)
        fp8 = Engine(lm.model, max_seq=96, kv_cache_dtype="fp8")
        assert fp8.cache.k[0].dtype == torch.float8_e4m3fn and fp8.cache.nbytes * 4 == full.cache.nbytes
        assert fp8.cache.bytes_per_token() * 4 == full.cache.bytes_per_token()
        ids = lm.tokenizer.encode(prompt)
        want, got = full.prefill(ids).reshape(-1), fp8.prefill(ids).reshape(-1)
        token = int(want.argmax())
        for pos in range(len(ids), len(ids) + 32):
            agree, steps = agree + (int(got.argmax()) == token), steps + 1
            assert (got - want).abs().max() <= 0.15 * want.abs().max(), (prompt, pos)
            want = full.decode(torch.tensor([token]), torch.tensor([pos])).reshape(-1)
            got = fp8.decode(torch.tensor([token]), torch.tensor([pos])).reshape(-1)
            token = int(want.argmax())
        # the first layer's keys (its input is the embeddings either way): the full cache's rounded to fp8, none
        # saturated
        k_full, k_fp8 = full.cache.k[0][0, :, :pos], fp8.cache.k[0][0, :, :pos].float()
        assert k_full.abs().max() < 448
        torch.testing.assert_close(k_fp8, k_full.to(torch.float8_e4m3fn).float(), rtol=2 ** -3, atol=2 ** -9)
    assert agree >= 0.9 * steps, (agree, steps)


def test_a_cache_dtype_that_is_not_one_is_named():
    from typer.testing import CliRunner

    from kilnx.cli import app
    from kilnx.runtime.kv_cache import cache_dtype
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8"):
        cache_dtype("fp4", torch.float32)
    for command in ("generate", "bench", "serve", "chat"):
        args = [command, "--model", "smollm2-135m", "--kv-cache-dtype", "int4"]
        r = CliRunner().invoke(app, args + (["--prompt", "x"] if command == "generate" else []))
        assert r.exit_code == 1 and "--kv-cache-dtype 'int4'" in r.output and "Traceback" not in r.output, command


def test_the_cli_generates_on_an_fp8_cache(smollm2_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from typer.testing import CliRunner

    from kilnx.cli import app
    r = CliRunner().invoke(app, ["generate", "--model", smollm2_path, "--prompt", PROMPTS[0], "--max-tokens", "6",
                                 "--device", "cpu", "--kv-cache-dtype", "fp8"])
    assert r.exit_code == 0, r.output
    assert "6 generated" in r.output
