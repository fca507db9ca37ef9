"""nemotron-3's MoE layers (E) in the hybrid stack (models/hybrid.py): ungated relu² experts chosen by a sigmoid router
whose correction bias steers the choice, weighted by the renormalized scores times routed_scaling_factor, beside a
shared relu² expert.

Truth: a tiny model written by mlx-lm (4-bit) gives mlx-lm's logits in kilnx, on the kernels and on the torch peer;
one written by HF transformers (per-expert tensors, as the released checkpoints store them) gives transformers' logits
when kilnx quantizes it as it loads (its weights are chosen exactly representable in 4 bits, so the comparison is
tight), and `kilnx convert` makes a directory mlx-lm runs to kilnx's logits. Chunked prefill then decode (both MoE
paths: per-slot GEMVs and grouped GEMMs) equals one forward. What kilnx does not run is refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kilnx.models.config import from_hf
from kilnx.models.errors import CheckpointError, UnsupportedArchitectureError
from kilnx.runtime.engine import Engine
from test_hybrid import HF as DENSE_HF, IDS, _write_hf_checkpoint, _write_mlx_checkpoint, full_logits  # noqa: E402  (this folder is on sys.path)

# test_hybrid's tiny nemotron-h with two of its layers MoE
HF = dict(DENSE_HF, hybrid_override_pattern="ME*E", n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
          moe_shared_expert_intermediate_size=128, n_shared_experts=1, routed_scaling_factor=2.5, n_group=1,
          topk_group=1, norm_topk_prob=True)


def test_logits_match_mlx_lm(tmp_path, backend):
    from kilnx.models.hybrid import HybridModel
    from kilnx.models.loaders import load_model
    from kilnx.quant import QWeight
    want = _write_mlx_checkpoint(tmp_path, True, HF)
    lm = load_model(str(tmp_path), device=backend.device, dtype=torch.float32, ops=backend.ops)
    assert isinstance(lm.model, HybridModel)
    layers = lm.model.weights.layers
    assert [layer.kind for layer in layers] == ["mamba", "moe", "attention", "moe"]
    assert isinstance(layers[1].moe.up, QWeight) and layers[1].moe.up.shape == (8, 64, 128)
    assert layers[1].moe.router.dtype == torch.float32 and not isinstance(layers[1].moe.router, QWeight)
    got = full_logits(lm.model, IDS).cpu().numpy()
    assert np.abs(want).max() > 4
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def _representable(shape, g: torch.Generator, group: int = 64) -> torch.Tensor:
    """Random weights that 4-bit group-64 affine quantization keeps exactly: each group is s * (q - 8) with codes
    0..15 (0 and 15 both present), so the quantizer's scale and bias are s and -8 s again (MLX's quantizer moves the
    scale so that zero is a code: with the bias -8 s it already is)."""
    q = torch.randint(0, 16, (*shape[:-1], shape[-1] // group, group), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    s = (torch.rand(*q.shape[:-1], 1, generator=g) + 0.5) * shape[-1] ** -0.5 / 4
    return (s * (q - 8)).reshape(shape)


def test_logits_match_hf_transformers_and_the_conversion_runs_in_mlx_lm(tmp_path):
    """HF's per-expert checkpoint: refused as it is (kilnx runs experts as quantized stacks), loaded with
    --quantize q4 (lossless on these weights) it gives transformers' logits; `kilnx convert` writes the stacks
    (switch_mlp.fc1 / fc2) and leaves the router dense, and mlx-lm runs that directory to kilnx's logits."""
    from kilnx.models.convert import convert, quant_format
    from kilnx.models.loaders import load_model
    g = torch.Generator().manual_seed(1)
    want = _write_hf_checkpoint(tmp_path / "hf", HF, lambda shape: _representable(shape, g), head_scale=8.0)
    with pytest.raises(CheckpointError, match="HF's layout.*--quantize q4"):
        load_model(str(tmp_path / "hf"), device="cpu", dtype=torch.float32)
    for ops in ("torch", "kilnx"):
        lm = load_model(str(tmp_path / "hf"), device="cpu", dtype=torch.float32, ops=ops, quantize="q4")
        got = full_logits(lm.model, IDS)
        assert want.abs().max() > 10
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    convert(str(tmp_path / "hf"), str(tmp_path / "q4"), quant_format("q4"))
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.utils import load_model as mlx_load
    theirs = np.array(mlx_load(tmp_path / "q4")[0](mx.array([IDS])).astype(mx.float32))[0]
    ours = full_logits(load_model(str(tmp_path / "q4"), device="cpu", dtype=torch.float32, ops="torch").model, IDS)
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=2e-4, atol=2e-4 * np.abs(theirs).max())


def tiny_moe(ops="torch", seed=0):
    from kilnx.models.hybrid import HybridModel
    from kilnx.models.loaders.random_init import RandomSource
    from kilnx.models.weights import build_weights
    cfg = from_hf(HF)
    src = RandomSource(cfg, fmt="q4", dtype=torch.float32, seed=seed)
    return HybridModel(cfg, build_weights(cfg, src, dtype=torch.float32), ops=ops)


def test_the_router_runs_in_fp32_in_a_bf16_model(monkeypatch):
    """HF keeps nemotron-3's router in fp32: its weight stays fp32 in a bf16 model, and the logits it routes on are fp32
    products of the bf16 activations (the experts' choice is not decided on 8-bit mantissas)."""
    from kilnx.models.hybrid import HybridModel
    from kilnx.models.loaders.random_init import RandomSource
    from kilnx.models.weights import build_weights
    cfg = from_hf(HF)
    model = HybridModel(cfg, build_weights(cfg, RandomSource(cfg, fmt="q4", dtype=torch.bfloat16, seed=0),
                                           dtype=torch.bfloat16), ops="torch")
    e = model.weights.layers[1].moe
    assert e.router.dtype == torch.float32 and e.router_bias.dtype == torch.float32
    seen = []
    real = model.ops.moe_route
    monkeypatch.setattr(model.ops, "moe_route", lambda logits, *a, **k: seen.append(logits.dtype) or real(logits, *a, **k))
    full_logits(model, IDS[:4])
    assert seen == [torch.float32, torch.float32]


def test_chunked_prefill_then_decode_equals_one_forward(backend):
    """A 9-token chunk runs the experts as grouped GEMMs, the 2-token one and the decode steps as per-slot GEMVs."""
    model = tiny_moe(backend.ops)
    ids = torch.randint(0, 320, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    full = full_logits(model, ids)
    eng = Engine(model, max_seq=64, prefill_chunk=9)
    got = [eng.prefill(ids[:11])]
    for t in range(11, 16):
        got.append(eng.decode(torch.tensor([ids[t]]), torch.tensor([t]))[0].clone())
    torch.testing.assert_close(torch.stack(got), full[10:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change,match", [(dict(n_group=2, topk_group=1), "n_group 2"),
                                          (dict(moe_latent_size=64), "latent projection"),
                                          (dict(n_shared_experts=0), "n_shared_experts 0")])
def test_what_kilnx_does_not_run_is_refused_by_name(change, match):
    with pytest.raises(UnsupportedArchitectureError, match=match):
        from_hf(dict(HF, **change))


def test_the_nano_preset_has_the_released_layer_stack():
    from kilnx.models.presets import get_preset
    cfg = get_preset("nemotron-3-nano-30b-a3b")
    assert [cfg.layer_kinds.count(k) for k in ("mamba", "moe", "attention")] == [23, 23, 6]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.router_scoring, cfg.routed_scaling_factor) == (128, 6, "sigmoid", 2.5)
    assert (cfg.moe_intermediate_size, cfg.shared_intermediate_size, cfg.hidden_size) == (1856, 3712, 2688)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_graph_steps_follow_the_torch_peer():
    """On the GPU, 4-bit bf16: a 300-token prefill (grouped GEMMs) and CUDA-graph decode steps of 2 rows (per-slot
    GEMVs) on the kernels follow the torch peer's logits, the peer choosing the tokens. Every token routed to all 8
    experts, as granite's GPU test does: a top-3 choice flips at near-ties between bf16 and the peer's float64."""
    from kilnx.models.hybrid import HybridModel
    from kilnx.models.loaders.random_init import RandomSource
    from kilnx.models.weights import build_weights
    engines = {}
    for ops in ("torch", "kilnx"):
        cfg = from_hf(dict(HF, max_position_embeddings=512, num_experts_per_tok=8))
        src = RandomSource(cfg, fmt="q4", dtype=torch.bfloat16, seed=1)
        engines[ops] = Engine(HybridModel(cfg, build_weights(cfg, src, dtype=torch.bfloat16, device="cuda"), ops=ops),
                              max_seq=512, max_batch=2, cuda_graphs=(ops == "kilnx"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (300, 17)]
    logits = {ops: torch.stack([e.prefill(p, row=r).float() for r, p in enumerate(prompts)])
              for ops, e in engines.items()}
    for step in range(5):
        want = logits["torch"]
        torch.testing.assert_close(logits["kilnx"], want, rtol=6e-2, atol=6e-2 * want.abs().max().item())
        tok = want.argmax(-1).cuda()
        pos = torch.tensor([len(p) + step for p in prompts], device="cuda")
        logits = {ops: e.decode(tok, pos).float().clone() for ops, e in engines.items()}
