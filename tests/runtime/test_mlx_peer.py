"""`kilnx bench --peer mlx`: mlx-lm builds the same preset (random 4-bit gs64) and its own generation loop
is timed in the same run; architectures mlx-lm cannot build from a kilnx config get one clear error."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import TINY

pytest.importorskip("mlx_lm")


def test_mlx_builds_the_presets_shapes():
    import importlib

    from kilnx.models.presets import get_preset
    from kilnx.runtime.mlx_peer import mlx_config
    cfg = get_preset("llama-3.2-1b")
    mod = importlib.import_module("mlx_lm.models.llama")
    model = mod.Model(mod.ModelArgs.from_dict(mlx_config(cfg)))
    layer = model.model.layers[0]
    assert len(model.model.layers) == cfg.num_layers
    assert layer.self_attn.q_proj.weight.shape == (cfg.num_heads * cfg.head_dim, cfg.hidden_size)
    assert layer.self_attn.k_proj.weight.shape == (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)
    assert layer.mlp.gate_proj.weight.shape == (cfg.intermediate_size, cfg.hidden_size)
    assert model.args.tie_word_embeddings == cfg.tie_embeddings
    assert model.args.rope_scaling["rope_type"] == "llama3"


def test_the_peer_rows_time_mlx_lm_on_the_same_prompts():
    from kilnx.runtime.mlx_peer import run_mlx_bench
    cfg = dataclasses.replace(TINY["llama"], max_position_embeddings=128)
    rows = run_mlx_bench(cfg, prompt_lens=[8, 20], gen=6, model_name="tiny", bandwidth_gbps=10.0, repeats=2)
    assert [r.prompt_len for r in rows] == [8, 20] and {r.ops for r in rows} == {"mlx-lm"}
    for r in rows:
        assert r.ttft_ms > 0 and r.decode_tok_s > 0 and r.weights == "random-q4" and r.device.startswith("mlx:")


def test_an_architecture_mlx_lm_cannot_build_is_refused():
    from kilnx.runtime.mlx_peer import PeerUnavailable, mlx_config
    with pytest.raises(PeerUnavailable, match="no mlx-lm model for architecture 'gemma3'"):
        mlx_config(TINY["gemma3"])


def test_cli_peer_mlx_needs_random_weights():
    from typer.testing import CliRunner

    from kilnx.runtime.cli import app
    r = CliRunner().invoke(app, ["bench", "--model", "smollm2-135m", "--peer", "mlx", "--device", "cpu"])
    out = r.output.strip()
    assert r.exit_code != 0 and "--peer mlx" in out and "--random" in out and "Traceback" not in out
