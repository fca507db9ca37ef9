"""granite 4.0 h (granitemoehybrid): Mamba-2 and attention mixers, each followed by an MLP (dense SwiGLU, or routed
experts beside a shared one), with granite's embedding / attention / residual / logits multipliers.

Truth: tiny checkpoints written by mlx-lm itself (dense with and without rotary positions, and a 4-bit MoE) give
mlx-lm's logits in kilnx, on the kernels and the torch peer; one written by HF transformers (dense, the gated norm in
two groups, rope) gives transformers' logits. The engine over its state: chunked prefill then decode steps equal
one forward (the MoE's decode path included).
"""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
import torch

from kilnx.runtime.engine import Engine

BASE = dict(model_type="granitemoehybrid", vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            max_position_embeddings=128, num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
            embedding_multiplier=2.0, attention_multiplier=0.015625, logits_scaling=8.0, residual_multiplier=0.5,
            layer_types=["mamba", "attention", "mamba", "mamba"], rms_norm_eps=1e-5, mamba_n_heads=8, mamba_d_head=16,
            mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True,
            position_embedding_type="nope", tie_word_embeddings=True, rope_theta=10000.0, time_step_limit=[0.0, 1e9],
            shared_intermediate_size=256)
CONFIGS = {"dense": BASE, "dense_rope": dict(BASE, position_embedding_type="rope"),
           "moe": dict(BASE, intermediate_size=64, shared_intermediate_size=96, num_local_experts=4,
                       num_experts_per_tok=2)}
IDS = [3, 17, 99, 250, 5, 61, 7, 128, 300, 42, 11]


def _random_params(named):
    """Trained ranges: decays in (0, 1), norms near 1, linears ~1/sqrt(K)."""
    out = {}
    for name, shape, normal, uniform in named:
        if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith(".D"):
            out[name] = 1.0 + 0.1 * normal(shape)
        elif name.endswith("A_log"):
            a = uniform(1, 16, shape)
            out[name] = a.log() if isinstance(a, torch.Tensor) else np.log(a)
        elif name.endswith("dt_bias"):
            out[name] = uniform(-4, -2, shape)
        elif "conv1d" in name:
            out[name] = 0.5 * normal(shape)
        else:
            out[name] = normal(shape) * shape[-1] ** -0.5
    return out


def _write_mlx_checkpoint(path, config: dict, quant: bool):
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import quantize_model, save_config, save_model
    module = importlib.import_module("mlx_lm.models.granitemoehybrid")
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(0)
    named = [(n, p.shape, lambda s: mx.random.normal(s), lambda lo, hi, s: mx.random.uniform(lo, hi, s))
             for n, p in tree_flatten(model.parameters())]
    params = {n: mx.array(v) if not isinstance(v, mx.array) else v for n, v in _random_params(named).items()}
    params["model.embed_tokens.weight"] = mx.random.normal((config["vocab_size"], config["hidden_size"])) * 0.5
    model.update(tree_unflatten(list(params.items())))
    if quant:
        model, config = quantize_model(model, dict(config), group_size=64, bits=4)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    return np.array(model(mx.array([IDS])).astype(mx.float32))[0]


def _logits(model, ids, max_seq=64):
    cache = model.new_cache(1, max_seq, dtype=torch.float32, device=model.device)
    dev = model.device
    with torch.no_grad():
        return model.forward(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None], cache)[0]


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_logits_match_mlx_lm(tmp_path, variant, backend):
    from kilnx.models.hybrid import HybridModel
    from kilnx.models.loaders import load_model
    config = CONFIGS[variant]
    want = _write_mlx_checkpoint(tmp_path, config, quant=variant == "moe")
    lm = load_model(str(tmp_path), device=backend.device, dtype=torch.float32, ops=backend.ops)
    assert isinstance(lm.model, HybridModel) and lm.config.nope == (variant != "dense_rope")
    layer = lm.model.weights.layers[0]
    assert layer.kind == "mamba" and (layer.ffn.router is not None) == (variant == "moe")
    got = _logits(lm.model, IDS).cpu().numpy()
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def _hf_granite(path, config: dict, **changes):
    """A tiny GraniteMoeHybridForCausalLM of HF transformers with random weights in trained ranges, saved to path as
    transformers saves it (layer_types as linear_attention / full_attention)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GraniteMoeHybridForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no GraniteMoeHybrid")
    keys = {k: v for k, v in config.items() if k not in ("model_type", "time_step_limit")}
    torch.manual_seed(0)
    model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**dict(keys, **changes))).eval()
    with torch.no_grad():
        named = [(n, tuple(p.shape), lambda s: torch.randn(s), lambda lo, hi, s: torch.rand(s) * (hi - lo) + lo)
                 for n, p in model.named_parameters()]
        for name, value in _random_params(named).items():
            model.get_parameter(name).copy_(torch.as_tensor(value))
    model.save_pretrained(path)
    return model


def test_logits_match_hf_transformers_with_a_grouped_gated_norm(tmp_path):
    from kilnx.models.loaders import load_model
    model = _hf_granite(tmp_path, BASE, mamba_n_groups=2, position_embedding_type="rope", num_local_experts=0,
                        mamba_expand=1)
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0].float()
    lm = load_model(str(tmp_path), device="cpu", dtype=torch.float32, ops="torch")
    assert lm.config.ssm_norm_groups == 2 and lm.config.layer_kinds == ("mamba", "attention", "mamba", "mamba")
    torch.testing.assert_close(_logits(lm.model, IDS), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_an_hf_moe_checkpoint_converts_to_the_directory_mlx_lm_runs(tmp_path):
    """HF's fused expert stacks (input_linear (E, 2F, H) [gate | up], output_linear) become mlx-lm's switch_mlp stacks
    in `kilnx convert` (the router at 8 bits, as mlx-lm's predicate keeps it): mlx-lm runs the directory to kilnx's
    logits, and the same checkpoint quantized as it loads gives the same logits. Loaded as it is, it is refused with
    the way out."""
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx_lm.utils import load_model as mlx_load

    from kilnx.models.convert import convert, quant_format
    from kilnx.models.errors import CheckpointError
    from kilnx.models.loaders import load_model
    _hf_granite(tmp_path / "hf", CONFIGS["moe"], shared_intermediate_size=128, mamba_expand=1)
    # the released checkpoints' spelling of the layer types (transformers 5 writes linear_attention / full_attention,
    # which this mlx-lm does not read)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["layer_types"] = CONFIGS["moe"]["layer_types"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="--quantize q4"):
        load_model(str(tmp_path / "hf"), device="cpu", dtype=torch.float32, ops="torch")
    convert(str(tmp_path / "hf"), str(tmp_path / "q4"), quant_format("q4"))
    theirs = np.array(mlx_load(tmp_path / "q4")[0](mx.array([IDS])).astype(mx.float32))[0]
    lm = load_model(str(tmp_path / "q4"), device="cpu", dtype=torch.float32, ops="torch")
    assert lm.model.weights.layers[0].ffn.router.bits == 8
    ours = _logits(lm.model, IDS).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=2e-4, atol=2e-4)
    at_load = load_model(str(tmp_path / "hf"), device="cpu", dtype=torch.float32, ops="torch", quantize="q4")
    np.testing.assert_array_equal(_logits(at_load.model, IDS).numpy(), ours)


def test_chunked_prefill_then_decode_equals_one_forward(tmp_path, backend):
    from kilnx.models.loaders import load_model
    _write_mlx_checkpoint(tmp_path, CONFIGS["moe"], quant=True)
    lm = load_model(str(tmp_path), device=backend.device, dtype=torch.float32, ops=backend.ops)
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    full = _logits(lm.model, ids)
    eng = Engine(lm.model, max_seq=64, prefill_chunk=16)
    got = [eng.prefill(ids[:35])]
    for t in range(35, 40):
        got.append(eng.decode(torch.tensor([ids[t]]), torch.tensor([t]))[0].clone())
    torch.testing.assert_close(torch.stack(got), full[34:], rtol=1e-4, atol=1e-4)


def _random_granite(variant: str, ops: str, device: str = "cpu", dtype=torch.float32, max_pos: int = 128, **changes):
    from kilnx.models.config import from_hf
    from kilnx.models.hybrid import HybridModel
    from kilnx.models.loaders.random_init import RandomSource
    from kilnx.models.weights import build_weights
    # every reduction a multiple of 64: the random source makes every linear 4-bit (its expert stacks come 4-bit only)
    cfg = from_hf(dict(CONFIGS[variant], max_position_embeddings=max_pos, shared_intermediate_size=128, **changes))
    src = RandomSource(cfg, fmt="q4", dtype=dtype, device=device, seed=1)
    return HybridModel(cfg, build_weights(cfg, src, dtype=dtype, device=device), ops=ops)


@pytest.mark.parametrize("variant", ["dense_rope", "moe"])
def test_random_weights_at_a_config_run_on_the_kernels_as_on_the_peer(variant, monkeypatch):
    """`--random` builds a granite model from its config alone (RandomSource names granite's tensors), and its logits on
    kilnx's kernels (numba) are the torch peer's."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want = _logits(_random_granite(variant, "torch"), IDS)
    got = _logits(_random_granite(variant, "kilnx"), IDS)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_moe_graph_steps_follow_the_torch_peer():
    """On the GPU (4-bit, bf16): a 300-token prefill and CUDA-graph decode steps of the MoE granite on the kernels
    equal the torch peer's at every step, the peer choosing the tokens."""
    # every token takes all 4 experts: bf16 and float64 router logits at a near-tie would pick different experts (a
    # top-2 model differed by 12% of the largest logit on an H100, session 28), which is not what this compares
    engines = {ops: Engine(_random_granite("moe", ops, "cuda", torch.bfloat16, 512, num_experts_per_tok=4), max_seq=512,
                           cuda_graphs=(ops == "kilnx")) for ops in ("torch", "kilnx")}
    prompt = torch.randint(0, 320, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = {ops: e.prefill(prompt).float() for ops, e in engines.items()}
    for step in range(6):
        want = logits["torch"]
        torch.testing.assert_close(logits["kilnx"], want, rtol=6e-2, atol=6e-2 * want.abs().max().item())  # as nemotron-h's
        tok = torch.tensor([int(want.argmax())], device="cuda")
        pos = torch.tensor([300 + step], device="cuda")
        logits = {ops: e.decode(tok, pos)[0].float().clone() for ops, e in engines.items()}
