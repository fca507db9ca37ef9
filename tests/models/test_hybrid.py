"""nemotron-h, the hybrid Mamba-2 / attention / MLP stack (models/hybrid.py).

Truth: a tiny nemotron-h written by mlx-lm itself (dense and 4-bit) gives mlx-lm's logits in kilnx, on the kernels
and on the torch peer; one written by HF transformers gives transformers' logits, and `kilnx convert` turns it into
a 4-bit directory mlx-lm runs to kilnx's logits. The engine over its recurrent state: chunked prefill then decode equals one full forward;
rows decoded together equal rows decoded alone, a parked row's state untouched; the CPU's recorded step equals
eager steps; the serving scheduler's text equals generate's. What cannot work on rows with state is refused by
name: speculative decoding. (nemotron-3's MoE layers: tests/models/test_nemotron_moe.py.)
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from kilnx.models.config import ModelConfig, from_hf
from kilnx.models.errors import UnsupportedArchitectureError
from kilnx.runtime.engine import Engine

HF = dict(model_type="nemotron_h", vocab_size=320, hidden_size=128, intermediate_size=256, max_position_embeddings=128,
          num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=False, mamba_num_heads=8,
          mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=2, mlp_bias=False,
          layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, hybrid_override_pattern="M-M*-M",
          tie_word_embeddings=False, eos_token_id=2)
IDS = [3, 17, 99, 250, 5, 61, 7, 128, 300, 42, 11]


def tiny_hybrid(ops="torch", device="cpu", fmt="bf16", seed=0, **changes):
    from kilnx.models.hybrid import HybridModel
    from kilnx.models.loaders.random_init import RandomSource
    from kilnx.models.weights import build_weights
    cfg = from_hf(dict(HF, **changes))
    src = RandomSource(cfg, fmt=fmt, dtype=torch.float32, seed=seed)
    return HybridModel(cfg, build_weights(cfg, src, dtype=torch.float32, device=device), ops=ops)


def full_logits(model, ids):
    cache = model.new_cache(1, 64, dtype=torch.float32, device=model.device)
    dev = model.device
    return model.forward(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None], cache)[0]


def _write_mlx_checkpoint(path, quant: bool, hf: dict = HF):
    """A tiny nemotron-h of mlx-lm's with random weights in trained ranges, saved as mlx-lm saves it (4-bit when
    `quant`); its logits of IDS. hf: the config (test_nemotron_moe.py's has MoE layers)."""
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import quantize_model, save_config, save_model
    module = importlib.import_module("mlx_lm.models.nemotron_h")
    config = dict(hf)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(0)
    params = {}
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight") or name.endswith(".D"):
            params[name] = 1.0 + 0.1 * mx.random.normal(p.shape)
        elif name.endswith("A_log"):
            params[name] = mx.log(mx.random.uniform(1, 16, p.shape))
        elif name.endswith("dt_bias"):
            params[name] = mx.random.uniform(-4, -2, p.shape)
        elif "conv1d" in name:
            params[name] = 0.5 * mx.random.normal(p.shape)
        elif name.endswith("e_score_correction_bias"):    # as large as the scores' spread: it moves the choice
            params[name] = 0.2 * mx.random.normal(p.shape)
        else:
            params[name] = mx.random.normal(p.shape) * p.shape[-1] ** -0.5
    params["backbone.embeddings.weight"] = mx.random.normal((hf["vocab_size"], hf["hidden_size"]))
    params["lm_head.weight"] = mx.random.normal((hf["vocab_size"], hf["hidden_size"])) * 2.0   # logits of O(5)
    model.update(tree_unflatten(list(params.items())))
    if quant:
        model, config = quantize_model(model, config, group_size=64, bits=4)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    return np.array(model(mx.array([IDS])).astype(mx.float32))[0]


def _write_hf_checkpoint(path, hf: dict = HF, linear=None, head_scale: float = 20.0):
    """A tiny NemotronHForCausalLM of HF transformers (its reference torch mixer), random weights in trained ranges,
    saved as HF saves it (conv1d (C, 1, K), infinity spelled {"__float__": "Infinity"}); its logits of IDS.
    linear(shape): the values of every weight of 2+ dims but the router's (default: randn / sqrt(K))."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "NemotronHForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no NemotronH")
    cfg = transformers.NemotronHConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(cfg).eval()
    linear = linear or (lambda shape: torch.randn(shape) * shape[-1] ** -0.5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand_like(p) * 15 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand_like(p) * 2 - 4)
            elif "norm" in name or name.endswith(".D"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "conv1d.weight" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("mixer.gate.weight"):      # an MoE layer's router (kept dense by kilnx)
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
            elif p.dim() >= 2:
                p.copy_(linear(p.shape))
            else:
                p.copy_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # as large as the scores' spread: it moves the choice
                b.copy_(0.2 * torch.randn_like(b))
        model.lm_head.weight.mul_(head_scale)
        model.save_pretrained(path)
        return model(torch.tensor([IDS])).logits[0].float()


def test_logits_match_hf_transformers_and_its_conversion_runs_in_mlx_lm(tmp_path):
    """A second independent implementation: HF transformers' NemotronH on its own saved checkpoint gives kilnx's
    logits (dense); `kilnx convert` makes it a 4-bit MLX directory that mlx-lm runs to kilnx's logits."""
    from kilnx.models.convert import convert, quant_format
    from kilnx.models.loaders import load_model
    want = _write_hf_checkpoint(tmp_path / "hf")
    lm = load_model(str(tmp_path / "hf"), device="cpu", dtype=torch.float32, ops="torch")
    with torch.no_grad():
        got = full_logits(lm.model, IDS)
    assert want.abs().max() > 20
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-4)
    counts = convert(str(tmp_path / "hf"), str(tmp_path / "q4"), quant_format("q4"))
    assert counts["quantized"] == 3 * 2 + 4 + 2 * 2 + 2       # mixers' in / out, q k v o, up / down, embed + head
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.utils import load_model as mlx_load
    theirs = np.array(mlx_load(tmp_path / "q4")[0](mx.array([IDS])).astype(mx.float32))[0]
    lm = load_model(str(tmp_path / "q4"), device="cpu", dtype=torch.float32, ops="torch")
    with torch.no_grad():
        ours = full_logits(lm.model, IDS).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=2e-4, atol=2e-4)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.parametrize("quant", [False, True])
def test_logits_match_mlx_lm(tmp_path, quant, backend):
    from kilnx.models.hybrid import HybridModel
    from kilnx.models.loaders import load_model
    want = _write_mlx_checkpoint(tmp_path, quant)
    lm = load_model(str(tmp_path), device=backend.device, dtype=torch.float32, ops=backend.ops)
    assert isinstance(lm.model, HybridModel)
    assert [layer.kind for layer in lm.model.weights.layers] == ["mamba", "mlp", "mamba", "attention", "mlp", "mamba"]
    if quant:
        from kilnx.quant import QWeight
        assert isinstance(lm.model.weights.layers[0].mamba.in_proj[0], QWeight)
    with torch.no_grad():
        got = full_logits(lm.model, IDS).cpu().numpy()
    assert np.abs(want).max() > 4
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("n,chunk", [(14, 4), (45, 32)])
def test_chunked_prefill_then_decode_equals_one_forward(backend, n, chunk):
    """Prefill chunks carry the state across (4, 4, 1 tokens; or 32 scanned in chunks of products and 8 token by
    token, against one forward's 40 in products), then decode steps."""
    model = tiny_hybrid(backend.ops, backend.device)
    ids = torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        full = full_logits(model, ids)
    eng = Engine(model, max_seq=64, prefill_chunk=chunk)
    got = [eng.prefill(ids[:n - 5])]
    for t in range(n - 5, n):
        got.append(eng.decode(torch.tensor([ids[t]]), torch.tensor([t]))[0].clone())
    torch.testing.assert_close(torch.stack(got), full[n - 6:], rtol=1e-4, atol=1e-4)
    # a new prompt in the same row starts from a zero state (its first token is at position 0)
    torch.testing.assert_close(eng.prefill(ids[:5]), full[4], rtol=1e-4, atol=1e-4)


def test_a_prompt_padded_at_the_last_position_leaves_the_state_and_logits_of_the_prompt_alone(backend):
    """What a prefill graph runs (engine.py): the prompt padded to a fixed length with tokens at the cache's parking
    slot. The prompt's last logits, the Mamba layers' states and the attention layers' keys of the prompt are
    those of the prompt alone, and the next decode step continues from them alike."""
    model = tiny_hybrid(backend.ops, backend.device)
    dev, n, pad, max_seq = model.device, 7, 9, 32
    runs = []
    for padded in (False, True):
        cache = model.new_cache(1, max_seq, dtype=torch.float32, device=dev, park=True)
        ids, pos = torch.tensor([IDS[:n]], device=dev), torch.arange(n, device=dev)[None]
        if padded:
            ids = torch.cat([ids, torch.full((1, pad), 5, device=dev)], 1)
            pos = torch.cat([pos, torch.full((1, pad), cache.park, device=dev)], 1)
        with torch.no_grad():
            last = model.forward(ids, pos, cache, last=torch.tensor([n - 1], device=dev))[0, -1].clone()
            step = model.forward(torch.tensor([[IDS[n]]], device=dev), torch.tensor([[n]], device=dev), cache)[0, -1]
        states = [t.clone() for t in cache.conv + cache.ssm if t is not None]
        keys = [k[:, :, :n + 1].clone() for k in cache.k if k is not None]   # (B, heads, slots, dim)
        runs.append((last, step.clone(), states, keys))
    (last_a, step_a, states_a, keys_a), (last_b, step_b, states_b, keys_b) = runs
    torch.testing.assert_close(last_b, last_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step_b, step_a, rtol=1e-5, atol=1e-5)
    for got, want in zip(states_b + keys_b, states_a + keys_a):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rows_decoded_together_equal_rows_decoded_alone_and_a_parked_row_keeps_its_state():
    model = tiny_hybrid()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 9, 3)]
    single = []
    for p in prompts:
        e = Engine(model, max_seq=32)
        e.prefill(p)
        single.append(e.decode(torch.tensor([7]), torch.tensor([len(p)]))[0].clone())
    eng = Engine(model, max_seq=32, max_batch=3)
    for row, p in enumerate(prompts):
        eng.prefill(p, row=row)
    kept = [t.clone() for t in eng.cache.rows(1, 2).ssm if t is not None]
    # row 1 parked at the cache's parking slot (as the scheduler parks a row it is still prefilling)
    out = eng.decode(torch.tensor([7, 7, 7]), torch.tensor([len(prompts[0]), eng.park, len(prompts[2])]))
    torch.testing.assert_close(out[[0, 2]], torch.stack(single)[[0, 2]], rtol=1e-4, atol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(kept, [t for t in eng.cache.rows(1, 2).ssm if t is not None]))
    torch.testing.assert_close(eng.decode(torch.tensor([7, 7, 7]), torch.tensor([len(p) for p in prompts]))[1],
                               single[1], rtol=1e-4, atol=1e-4)


def test_the_contexts_last_position_is_a_real_token():
    """The engine's cache parks one slot past the context, so a token at the context's last position (max_seq - 1)
    is real: its decode step writes the state (when parking shared that position, the state after it was lost) and
    its logits equal a full forward's."""
    model = tiny_hybrid()
    eng = Engine(model, max_seq=len(IDS))
    assert eng.park == len(IDS) and eng.cache.slots == len(IDS) + 1
    eng.prefill(IDS[:-1])
    before = [t.clone() for t in eng.cache.ssm if t is not None]
    last = eng.decode(torch.tensor([IDS[-1]]), torch.tensor([len(IDS) - 1]))[0]
    assert not any(torch.equal(a, b) for a, b in zip(before, [t for t in eng.cache.ssm if t is not None]))
    torch.testing.assert_close(last, full_logits(model, IDS)[-1], rtol=1e-4, atol=1e-4)


def test_cpu_replay_equals_eager_decode(monkeypatch):
    """The CPU engine runs its first step twice (eager, then recorded): the state is put back between the two,
    so the replayed steps continue from the right one."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_hybrid("kilnx")
    runs = {}
    for replay in (False, True):
        eng = Engine(model, max_seq=32, cpu_replay=replay)
        tok = int(eng.prefill(IDS[:6]).argmax())
        runs[replay] = []
        for t in range(6, 12):
            logits = eng.decode(torch.tensor([tok]), torch.tensor([t]))[0].clone()
            runs[replay].append(logits)
            tok = int(logits.argmax())
    assert eng._replays[1] is not None, eng.replay_refused
    torch.testing.assert_close(torch.stack(runs[True]), torch.stack(runs[False]), rtol=0, atol=0)


def test_the_cli_ops_run_it_on_the_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    auto = tiny_hybrid("auto")
    with torch.no_grad():
        got = full_logits(auto, IDS)
    assert not auto.ops.fell_back
    torch.testing.assert_close(got, full_logits(tiny_hybrid("kilnx"), IDS), rtol=0, atol=0)


@pytest.mark.parametrize("lookahead", [False, True])
def test_the_scheduler_gives_each_request_its_tokens_alone(lookahead):
    """Five requests on two rows (rows reused, free and prefilling rows parked in the steps; a prompt that repeats
    only part of an earlier one's history starts over): each request's tokens are those it gets alone. With
    lookahead a step is enqueued before the previous one's tokens are read."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "runtime"))
    from outcomes import Outcomes

    from kilnx.runtime.generate import generate_ids
    from kilnx.runtime.sampling import SamplingParams
    from kilnx.runtime.scheduler import Scheduler
    model = tiny_hybrid()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    prompts.append(prompts[0] + [7, 8])
    budgets = (6, 3, 8, 5, 4)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in budgets]
    outcomes = Outcomes(len(prompts))
    with Scheduler(Engine(model, max_seq=48, max_batch=2), lookahead=lookahead, prefix_slots=4) as sched:
        assert sched.store is None
        for i, (p, sp) in enumerate(zip(prompts, params)):
            sched.submit(p, sp, outcomes.listener(i))
        done = outcomes.wait(300)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        alone = [t for t in generate_ids(Engine(model, max_seq=48), p, sp) if isinstance(t, int)]
        assert list(done[i].token_ids) == alone


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_conversations_next_turn_continues_the_rows_state(lookahead):
    """A turn whose prompt begins with everything the row's state has taken (the last turn's prompt and answer, as a
    chat renders them) prefills only the rest, and gets the tokens it gets from scratch."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "runtime"))
    from outcomes import Outcomes

    from kilnx.runtime.generate import generate_ids
    from kilnx.runtime.sampling import SamplingParams
    from kilnx.runtime.scheduler import Scheduler
    model = tiny_hybrid()
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    first = IDS[:6]
    with Scheduler(Engine(model, max_seq=48, max_batch=1), lookahead=lookahead) as sched:
        outcomes = Outcomes(1)
        sched.submit(first, params, outcomes.listener(0))
        answer = list(outcomes.wait(300)[0].token_ids)
        second = first + answer + [9, 10]
        outcomes = Outcomes(1)
        sched.submit(second, params, outcomes.listener(0))
        done = outcomes.wait(300)[0]
    assert done.cached_tokens in (len(first) + 4, len(first) + 5)   # the answer's last token: fed by a step ahead, or not
    assert list(done.token_ids) == [t for t in generate_ids(Engine(model, max_seq=48), second, params)
                                    if isinstance(t, int)]


def test_speculative_decoding_is_refused_by_name():
    from kilnx.runtime.generate import generate_ids
    from kilnx.runtime.sampling import SamplingParams
    from kilnx.runtime.scheduler import Scheduler
    from kilnx.runtime.speculative import PromptLookup
    eng = Engine(tiny_hybrid(), max_seq=32)
    with pytest.raises(UnsupportedArchitectureError, match="recurrent state"):
        eng.verify([1, 2], row=0, start=3)
    with pytest.raises(UnsupportedArchitectureError, match="--prompt-lookup"):
        next(generate_ids(eng, IDS, SamplingParams(max_tokens=3), proposer=PromptLookup()))
    with pytest.raises(UnsupportedArchitectureError, match="recurrent state"):
        Scheduler(eng, proposer=PromptLookup())


def test_configs_it_cannot_run_are_refused_by_name():
    with pytest.raises(UnsupportedArchitectureError, match=r"MoE layers \(E\) without n_routed_experts"):
        from_hf(dict(HF, hybrid_override_pattern="ME*"))      # nemotron-3's MoE: tests/models/test_nemotron_moe.py
    with pytest.raises(UnsupportedArchitectureError, match="hybrid_override_pattern"):
        from_hf({k: v for k, v in HF.items() if k != "hybrid_override_pattern"})
    with pytest.raises(UnsupportedArchitectureError, match="mlp_bias"):
        from_hf(dict(HF, mlp_bias=True))
    cfg = from_hf(dict(HF, layers_block_type=["mamba", "attention", "mlp"], hybrid_override_pattern=None))
    assert isinstance(cfg, ModelConfig) and cfg.layer_kinds == ("mamba", "attention", "mlp") and cfg.num_layers == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("batch", [1, 3])
def test_gpu_graph_steps_follow_the_torch_peer(batch):
    """On the GPU, 4-bit bf16: a 300-token prefill (dense GEMM path) and CUDA-graph decode steps of `batch` rows on
    the kernels equal the torch peer's at every step, the peer choosing the tokens."""
    engines = {}
    for ops in ("torch", "kilnx"):
        from kilnx.models.hybrid import HybridModel
        from kilnx.models.loaders.random_init import RandomSource
        from kilnx.models.weights import build_weights
        cfg = from_hf(dict(HF, max_position_embeddings=512))
        src = RandomSource(cfg, fmt="q4", dtype=torch.bfloat16, seed=1)
        m = HybridModel(cfg, build_weights(cfg, src, dtype=torch.bfloat16, device="cuda"), ops=ops)
        # 3 rows in a 4-row engine: the step replays the 4-row graph, its spare row parked
        engines[ops] = Engine(m, max_seq=512, max_batch=batch + (batch > 1), cuda_graphs=(ops == "kilnx"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (300, 17, 40)[:batch]]
    logits = {ops: torch.stack([e.prefill(p, row=r).float() for r, p in enumerate(prompts)])
              for ops, e in engines.items()}
    for step in range(6):
        want = logits["torch"]
        # bf16 activations against the peer's float64 scan: on an H100 each row's largest difference was 2-5% of its
        # largest logit at every step, CUDA graphs and eager alike, one row or three (session 28)
        torch.testing.assert_close(logits["kilnx"], want, rtol=6e-2, atol=6e-2 * want.abs().max().item())
        tok = want.argmax(-1).cuda()
        pos = torch.tensor([len(p) + step for p in prompts], device="cuda")
        logits = {ops: e.decode(tok, pos).float().clone() for ops, e in engines.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_prefill_graphs_pad_at_the_parking_position_and_decode_on_from_the_prompts_state():
    """Prompts of 17 and 23 tokens replay one 32-token prefill graph (the first captures it, the second replays it
    into a row whose state the first left), then decode steps: the logits are those of an engine prefilling eagerly,
    to the rounding of the other kernels a 32-token forward takes (the chunked scan, 32-row GEMM tiles)."""
    from kilnx.models.hybrid import HybridModel
    from kilnx.models.loaders.random_init import RandomSource
    from kilnx.models.weights import build_weights
    cfg = from_hf(dict(HF, max_position_embeddings=512))
    m = HybridModel(cfg, build_weights(cfg, RandomSource(cfg, fmt="q4", dtype=torch.bfloat16, seed=1),
                                       dtype=torch.bfloat16, device="cuda"), ops="kilnx")
    graphed, eager = Engine(m, max_seq=256), Engine(m, max_seq=256)
    eager.prefill_graph_max = 0
    g = torch.Generator().manual_seed(6)
    for n in (17, 23):
        ids = torch.randint(0, 320, (n,), generator=g).tolist()
        got, want = [graphed.prefill(ids).float()], [eager.prefill(ids).float()]
        for t in range(4):
            tok, pos = want[-1].argmax().view(1), torch.tensor([n + t], device="cuda")
            got.append(graphed.decode(tok, pos)[0].float().clone())
            want.append(eager.decode(tok, pos)[0].float().clone())
        want = torch.stack(want)
        torch.testing.assert_close(torch.stack(got), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert (0, 32) in graphed._prefill_graphs, graphed.prefill_graph_refused


def test_an_fp8_kv_cache_holds_only_the_attention_layers_keys_in_fp8():
    """--kv-cache-dtype fp8 narrows the attention layers' K and V; the recurrent state keeps the model's dtype (conv)
    and fp32 (scan). The cache's size counts both, its bytes per token only K and V."""
    model = tiny_hybrid()
    eng = Engine(model, max_seq=32, kv_cache_dtype="fp8")
    kinds = [layer.kind for layer in model.weights.layers]
    assert [t is not None for t in eng.cache.k] == [k == "attention" for k in kinds]
    assert eng.cache.k[3].dtype == torch.float8_e4m3fn and eng.cache.conv[0].dtype == torch.float32
    assert eng.cache.ssm[0].dtype == torch.float32 and eng.cache.conv[1] is None
    assert eng.cache.bytes_per_token() == 2 * 1 * 2 * 32 * 1                 # one attention layer, 2 KV heads of 32
    assert eng.cache.state_nbytes_per_row == 3 * (3 * 192 * 4 + 8 * 16 * 16 * 4)   # conv: I + 2 G N = 192 channels
    want = full_logits(model, IDS)[-1]
    got = eng.prefill(IDS)
    assert int(got.argmax()) == int(want.argmax())
    torch.testing.assert_close(got, want, rtol=0.1, atol=0.1 * float(want.abs().max()))
