"""Engine consistency: chunked prefill, incremental decode and batched decode all agree with one
full-sequence forward, for every architecture (tiny random weights)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY, tiny_model

from kilnx.models.errors import ContextLengthError
from kilnx.runtime.engine import Engine
from kilnx.runtime.kv_cache import KVCache
from kilnx.runtime.sampling import SamplingParams

ARCHS = list(TINY)


def _full_logits(model, ids):
    dev = model.device
    cache = KVCache.for_model(model.config, 1, 64, device=dev)
    return model.forward(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None], cache)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_matches_full_forward(arch, backend):
    model = tiny_model(arch, ops=backend.ops, device=backend.device)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    full = _full_logits(model, ids)
    eng = Engine(model, max_seq=32, prefill_chunk=5)
    got = [eng.prefill(ids[:7])]
    for t in range(7, 12):
        got.append(eng.decode(torch.tensor([ids[t]]), torch.tensor([t]))[0].clone())  # graphs reuse the buffer
    torch.testing.assert_close(torch.stack(got), full[6:], rtol=1e-4, atol=1e-4)


def test_prefill_buckets_pad_to_16_32_64_then_multiples_of_64():
    from kilnx.runtime.engine import prefill_bucket
    got = {n: prefill_bucket(n, 512) for n in (1, 16, 17, 33, 64, 65, 128, 129, 500, 512, 513)}
    assert got == {1: 16, 16: 16, 17: 32, 33: 64, 64: 64, 65: 128, 128: 128, 129: 192, 500: 512, 512: 512,
                   513: None}
    assert prefill_bucket(100, 64) is None


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
@pytest.mark.parametrize("cache_len", [32, 13])
def test_a_prompt_padded_after_its_end_keeps_its_last_tokens_logits(arch, cache_len):
    """What a graph-replayed prefill relies on: tokens padded after the prompt (at the following positions,
    those past the cache's end all at its last one) change neither the logits of the prompt's last token,
    read through `last`, nor the cache below the prompt's end."""
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(4))
    caches = [KVCache.for_model(model.config, 1, cache_len) for _ in range(2)]
    want = model.forward(ids[None], torch.arange(11)[None], caches[0], last=-1)
    padded = torch.cat([ids, torch.zeros(5, dtype=torch.long)])
    positions = torch.arange(16).clamp(max=cache_len - 1)
    got = model.forward(padded[None], positions[None], caches[1], last=torch.tensor([10]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for layer in range(model.config.num_layers):
        torch.testing.assert_close(caches[1].k[layer][:, :, :11], caches[0].k[layer][:, :, :11])
        torch.testing.assert_close(caches[1].v[layer][:, :, :11], caches[0].v[layer][:, :, :11])


@pytest.mark.parametrize("arch", ["gemma3", "llama"])   # tied (with gemma's scale) and untied, 4-bit
def test_a_quantized_embedding_is_looked_up_from_its_codes(arch, backend):
    """A 4-bit checkpoint keeps its embedding as codes (no dense table; tied, the lm_head's own): the logits
    equal those of the same model over the dense table those codes make."""
    import dataclasses

    from kilnx.models.llama import LlamaModel
    from kilnx.models.weights import QuantEmbedding
    model = tiny_model(arch, ops=backend.ops, fmt="q4", device=backend.device)
    embed = model.weights.embed
    assert isinstance(embed, QuantEmbedding)
    assert (embed.weight is model.weights.lm_head[0]) is model.config.tie_embeddings
    dense = dataclasses.replace(model.weights, embed=embed[torch.arange(model.config.vocab_size)])
    twin = LlamaModel(model.config, dense, ops=backend.ops)
    ids = torch.randint(0, 256, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    torch.testing.assert_close(_full_logits(model, ids), _full_logits(twin, ids), rtol=1e-5, atol=1e-5)


def test_a_tied_dense_embedding_is_the_lm_heads_own_table():
    """An unquantized tied checkpoint's embedding and lm_head are one tensor in memory (unscaled: gemma's
    scale makes the lookup table a scaled copy)."""
    model = tiny_model("qwen3")
    assert model.weights.embed is model.weights.lm_head[0]


def test_embeddings_stay_quantized_unless_asked_not_to(monkeypatch):
    """A quantized table stays quantized on every device; KILNX_QUANT_EMBED=0 makes it dense."""
    from kilnx.models.weights import quant_embedding
    from kilnx.quant import QWeight
    w = QWeight.quantize(torch.randn(8, 64))
    assert quant_embedding(w, 1.0, torch.float32) is not None
    monkeypatch.setattr(QWeight, "device", property(lambda self: torch.device("cuda")))
    assert quant_embedding(w, 1.0, torch.float32) is not None
    monkeypatch.setenv("KILNX_QUANT_EMBED", "0")
    assert quant_embedding(w, 1.0, torch.float32) is None


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_decode_matches_single(arch, backend):
    model = tiny_model(arch, ops=backend.ops, device=backend.device)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 3)]
    single = []
    for p in prompts:
        e = Engine(model, max_seq=32)
        e.prefill(p)
        single.append(e.decode(torch.tensor([7]), torch.tensor([len(p)]))[0].clone())
    eng = Engine(model, max_seq=32, max_batch=3)
    for row, p in enumerate(prompts):
        eng.prefill(p, row=row)
    batched = eng.decode(torch.tensor([7, 7, 7]), torch.tensor([len(p) for p in prompts]))
    torch.testing.assert_close(batched, torch.stack(single), rtol=1e-4, atol=1e-4)


def test_generate_ids_greedy_and_stats():
    from kilnx.runtime.generate import GenerationStats, generate_ids
    model = tiny_model("llama")
    ids = [5, 6, 7, 8]
    out = list(generate_ids(Engine(model, max_seq=32), ids, SamplingParams(max_tokens=6, ignore_eos=True)))
    toks, stats = out[:-1], out[-1]
    assert isinstance(stats, GenerationStats) and stats.generated_tokens == 6 == len(toks)
    seq = list(ids)
    for t in toks:   # each token is the argmax of a full forward over everything before it
        assert t == int(_full_logits(model, seq)[-1].argmax())
        seq.append(t)
    assert stats.ttft_s > 0 and stats.decode_tok_s > 0 and stats.stop_reason == "max_tokens"


def test_context_limits():
    from kilnx.runtime.generate import generate_ids
    model = tiny_model("llama")
    eng = Engine(model, max_seq=16)
    with pytest.raises(ContextLengthError, match="shorten the prompt"):
        eng.prefill(list(range(20)))
    # Fits, but generation is cut at the end of the context with an honest stop reason.
    stats = list(generate_ids(eng, list(range(10)), SamplingParams(max_tokens=50, ignore_eos=True)))[-1]
    assert stats.generated_tokens == 6 and stats.stop_reason == "context"


@pytest.mark.parametrize("cpu_backend", ["numba", "triton-interpreter"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dsl_kernels_on_cpu_give_the_torch_peers_logits(arch, cpu_backend, monkeypatch):
    """The whole forward on kilnx's own kernels (numba, or Triton's interpreter) equals the torch peer."""
    monkeypatch.setenv("TRITON_INTERPRET", "1" if cpu_backend == "triton-interpreter" else "0")
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    want = _full_logits(tiny_model(arch, ops="torch", device="cpu"), ids)
    got = _full_logits(tiny_model(arch, ops="kilnx", device="cpu"), ids)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_cli_ops_serve_every_architecture_on_the_kernels(arch, monkeypatch):
    """The CLI's ops ("auto": kilnx.ops, torch eager only where a kernel is missing) have every op a model
    calls, and on the CPU every one of them runs on a kernel: the logits are kilnx.ops' and nothing fell back."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ids = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    auto = tiny_model(arch, ops="auto", device="cpu")
    got = _full_logits(auto, ids)
    assert not auto.ops.fell_back
    torch.testing.assert_close(got, _full_logits(tiny_model(arch, ops="kilnx", device="cpu"), ids), rtol=0, atol=0)


@pytest.mark.parametrize("arch,replayed", [("llama", True), ("qwen2", False), ("qwen3_moe", True)])
def test_cpu_replay_equals_eager_decode(arch, replayed, monkeypatch):
    """The CPU engine records its first decode step's launches and replays them: the logits of every
    later step are those of eager steps (qwen3-moe's too: routing, expert GEMVs and the weighted sum are all
    launches). qwen2's bias add is a torch op in the step, so it stays eager."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_model(arch, ops="kilnx", device="cpu")
    ids = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = {}
    for replay in (False, True):
        eng = Engine(model, max_seq=32, cpu_replay=replay)
        tok = int(eng.prefill(ids).argmax())
        runs[replay] = []
        for t in range(6, 12):
            logits = eng.decode(torch.tensor([tok]), torch.tensor([t]))[0].clone()   # replay reuses the buffer
            runs[replay].append(logits)
            tok = int(logits.argmax())
    assert (eng._replays[1] is not None) == replayed, eng.replay_refused
    torch.testing.assert_close(torch.stack(runs[True]), torch.stack(runs[False]), rtol=0, atol=0)


def test_recorder_refuses_a_strided_copy(monkeypatch):
    """A launch that copies a strided operand first cannot be replayed (the copy is not a launch)."""
    from kilnx.codegen.numba_launch import Recorder
    from kilnx.kernels import activations
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(8, 4).t()        # last stride 8
    with Recorder() as rec:
        activations.scaled_add(x, torch.randn(4, 8), 0.5)
    assert rec.refused and len(rec.steps) == 1


@pytest.mark.parametrize("lookahead", ["0", "1", "3"])
def test_steps_enqueued_ahead_give_the_same_tokens_and_stop_where_the_synchronous_loop_does(lookahead, monkeypatch):
    """Steps run ahead of the host (the GPU's pipelined decode) compute the tokens the one-at-a-time loop
    does; a stop token ends the output at the same place, and what the extra steps wrote past it (K/V
    beyond the sequence's end) does not change the next generation in the same engine."""
    from kilnx.runtime.generate import generate_ids
    model = tiny_model("llama")
    prompt = [3, 1, 4, 1, 5]

    def run(eng, params):
        *toks, stats = generate_ids(eng, prompt, params)
        return toks, stats

    monkeypatch.setenv("KILNX_DECODE_LOOKAHEAD", "0")
    ref, _ = run(Engine(model, max_seq=32), SamplingParams(max_tokens=12, ignore_eos=True))
    monkeypatch.setenv("KILNX_DECODE_LOOKAHEAD", lookahead)
    eng = Engine(model, max_seq=32)
    toks, stats = run(eng, SamplingParams(max_tokens=12, ignore_eos=True))
    assert toks == ref and stats.generated_tokens == 12
    stop = ref[4]
    cut, stats = run(eng, SamplingParams(max_tokens=12, stop_token_ids=(stop,)))
    assert cut == ref[:ref.index(stop) + 1] and stats.stop_reason == "stop_token"
    again, _ = run(eng, SamplingParams(max_tokens=12, ignore_eos=True))
    assert again == ref
    # sampled, seeded: the same draws whether the steps run ahead or not
    monkeypatch.setenv("KILNX_DECODE_LOOKAHEAD", "0")
    sampled_ref, _ = run(Engine(model, max_seq=32), SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=3,
                                                                   ignore_eos=True))
    monkeypatch.setenv("KILNX_DECODE_LOOKAHEAD", lookahead)
    sampled, _ = run(Engine(model, max_seq=32), SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=3,
                                                               ignore_eos=True))
    assert sampled == sampled_ref


def test_a_bench_row_holds_the_median_of_its_measured_runs(monkeypatch):
    """`kilnx bench --repeats 3`: every figure of a row is the median of the three measured runs of that
    prompt (warm-up runs excluded), so one slow or fast run does not set the number."""
    from types import SimpleNamespace

    from kilnx.runtime import bench
    model = tiny_model("llama")
    measured, real = [], bench._run

    def run(engine, ids, params):
        st = real(engine, ids, params)
        if params.max_tokens == 5:
            measured.append(st)
        return st

    monkeypatch.setattr(bench, "_run", run)
    rows = bench.run_bench(SimpleNamespace(config=model.config, model=model), prompt_lens=[8], gen=5,
                           model_name="tiny", weights="random", ops_name="kilnx", bandwidth_gbps=100.0, repeats=3)
    assert len(measured) == 3 and len(rows) == 1
    for field, scale in (("decode_tok_s", 1), ("prefill_tok_s", 1), ("ttft_s", 1e3)):
        values = sorted(getattr(st, field) for st in measured)
        got = getattr(rows[0], "ttft_ms" if field == "ttft_s" else field)
        assert got == pytest.approx(values[1] * scale)


def test_each_bench_row_decodes_on_a_cache_sized_for_its_own_prompt(monkeypatch):
    """As `kilnx generate` sizes its cache (prompt + tokens + 1), so does each of a bench run's prompt
    lengths: a short prompt's row is not timed on a cache sized for the run's longest prompt."""
    from types import SimpleNamespace

    from kilnx.runtime import bench
    model = tiny_model("llama")
    seen, real = {}, bench._run

    def run(engine, ids, params):
        if params.max_tokens == 5:
            seen[len(ids)] = engine.max_seq
        return real(engine, ids, params)

    monkeypatch.setattr(bench, "_run", run)
    bench.run_bench(SimpleNamespace(config=model.config, model=model), prompt_lens=[4, 12], gen=5,
                    model_name="tiny", weights="random", ops_name="kilnx", bandwidth_gbps=100.0)
    assert seen == {4: 4 + 5 + 1, 12: 12 + 5 + 1}


def test_a_malformed_lookahead_setting_is_named_in_the_error(monkeypatch):
    from kilnx.runtime.generate import generate_ids
    monkeypatch.setenv("KILNX_DECODE_LOOKAHEAD", "soon")
    with pytest.raises(ValueError, match="KILNX_DECODE_LOOKAHEAD='soon'"):
        list(generate_ids(Engine(tiny_model("llama"), max_seq=32), [1, 2, 3], SamplingParams(max_tokens=3)))


def test_a_batched_bench_decodes_each_row_as_greedy_alone_would(monkeypatch):
    """`kilnx bench --batch B`: B prompts of one length decode together, and every row's tokens are those that
    row's prompt gives when greedy-decoded alone; the row reports the batch, the decode rate summed over the
    rows, and a roofline that charges the weights once a step."""
    from types import SimpleNamespace

    from kilnx.runtime import bench
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (6,), generator=g).tolist() for _ in range(3)]
    _, rate, together = bench.batched_greedy(Engine(model, max_seq=16, max_batch=3), prompts, 5)
    from kilnx.runtime.generate import generate_ids
    alone = [[t for t in generate_ids(Engine(model, max_seq=16), p, SamplingParams(max_tokens=5, ignore_eos=True))
              if isinstance(t, int)] for p in prompts]
    assert together == alone and rate > 0
    lm = SimpleNamespace(config=model.config, model=model)
    one, two = (bench.run_bench(lm, prompt_lens=[6], gen=4, model_name="tiny", weights="random", ops_name="kilnx",
                                bandwidth_gbps=100.0, batch=b)[0] for b in (1, 2))
    assert (one.batch, two.batch) == (1, 2)
    assert two.bytes_per_decode_token == one.bytes_per_decode_token - one.weight_bytes // 2
    with pytest.raises(ValueError, match="one length"):
        bench.batched_greedy(Engine(model, max_seq=16, max_batch=2), [[1, 2], [3]], 2)


@pytest.mark.parametrize("lookahead", ["0", "1"])
def test_generate_counts_penalties_as_the_server_does(lookahead, monkeypatch):
    """`kilnx generate`'s loop (steps enqueued ahead or not) with repetition / frequency penalties gives the
    tokens the scheduler gives, which tests/runtime/test_scheduler.py checks against the formula."""
    from kilnx.runtime.generate import generate_ids
    from kilnx.runtime.scheduler import Scheduler
    monkeypatch.setenv("KILNX_DECODE_LOOKAHEAD", lookahead)
    model = tiny_model("llama")
    sp = SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=1.5, repetition_penalty=1.3)
    ids = torch.randint(3, 256, (7,), generator=torch.Generator().manual_seed(9)).tolist()
    got = [t for t in generate_ids(Engine(model, max_seq=32), ids, sp) if isinstance(t, int)]
    with Scheduler(Engine(model, max_seq=32)) as sched:
        want = list(list(sched.stream(ids, sp))[-1].token_ids)
    plain = [t for t in generate_ids(Engine(model, max_seq=32), ids, SamplingParams(max_tokens=10, ignore_eos=True))
             if isinstance(t, int)]
    assert got == want and got != plain


def test_a_mixed_forward_is_a_prefill_chunk_and_a_decode_step(monkeypatch):
    """Engine.mixed: a prompt's chunk into one row and a decode step of rows 0..B-1 in one forward (each weight
    read once) give the chunk's last logits and the step's logits of the two calls it replaces."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for arch in ARCHS:        # the MoE one too (its experts over the chunk's and the step's tokens together)
        m = tiny_model(arch, ops="kilnx")
        prompts = [[5, 9, 2, 7], [3, 3, 8], [11, 4, 6, 1, 2]]
        chunk = [7, 1, 9, 4, 4, 2, 8, 3, 5]
        got = {}
        for mixed in (False, True):
            e = Engine(m, max_seq=32, max_batch=4, cpu_replay=False)
            firsts = [int(e.prefill(p, row=r).argmax()) for r, p in enumerate(prompts)]
            toks = torch.tensor(firsts + [0])
            pos = torch.tensor([len(p) for p in prompts] + [e.park])         # row 3 prefills: parked
            e.prefill(chunk[:4], row=3)
            if mixed:
                got[mixed] = e.mixed(toks, pos, chunk[4:], 3, 4)
            else:
                got[mixed] = (e.decode(toks, pos).clone(), e.prefill(chunk[4:], row=3, start=4))
        torch.testing.assert_close(got[True][0][:3], got[False][0][:3], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[True][1], got[False][1], rtol=1e-4, atol=1e-4)
