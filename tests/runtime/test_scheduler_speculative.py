"""Speculative decoding in the server's scheduler (runtime/scheduler.py): the rows decoding take speculative
rounds, together in one forward where their proposers are their own; what a request gets is what it gets without
them — the same greedy tokens, the same log-probabilities, the same ends at stop tokens and max_tokens."""

from __future__ import annotations

import pytest
import torch
from outcomes import Outcomes
from tiny_models import WrongGuesses, tiny_model

from kilnx.runtime.engine import Engine
from kilnx.runtime.generate import generate_ids
from kilnx.runtime.sampling import SamplingParams
from kilnx.runtime.scheduler import Scheduler
from kilnx.runtime.speculative import DraftModel, PromptLookup

REPEATING = [5, 9, 17, 33, 5, 9, 17, 33, 5, 9]     # prompt lookup has something to guess from


def _alone(model, ids, params, max_seq=64):
    return [t for t in generate_ids(Engine(model, max_seq=max_seq), ids, params) if isinstance(t, int)]


def _served(model, requests, proposer, *, max_batch=2, logprobs=None, lookahead=False, speculate_rows=None):
    """Each (prompt, params) submitted at once: (their Finished, their log-probability events, the scheduler)."""
    outcomes, events = Outcomes(len(requests)), {i: [] for i in range(len(requests))}

    def listener(i):
        done = outcomes.listener(i)

        def on_event(kind, payload):
            if kind == "logprobs":
                events[i].extend(payload)
            done(kind, payload)
        return on_event
    with Scheduler(Engine(model, max_seq=64, max_batch=max_batch), proposer=proposer, lookahead=lookahead,
                   speculate_rows=speculate_rows) as s:
        for i, (ids, params) in enumerate(requests):
            s.submit(ids, params, listener(i), logprobs=logprobs)
        done = outcomes.wait(300)
    return done, events, s


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("proposer", ["lookup", "other_model", "itself"])
def test_a_lone_request_gets_its_plain_greedy_tokens_in_fewer_steps(proposer, lookahead, backend):
    target = tiny_model("llama", ops=backend.ops, seed=0, device=backend.device)
    make = {"lookup": lambda: PromptLookup(3),
            "other_model": lambda: DraftModel(tiny_model("llama", ops=backend.ops, seed=1, device=backend.device), 3),
            "itself": lambda: DraftModel(target, 4)}[proposer]
    params = SamplingParams(max_tokens=21, ignore_eos=True)
    done, _, s = _served(target, [(REPEATING, params)], make(), lookahead=lookahead)
    assert list(done[0].token_ids) == _alone(target, REPEATING, params)
    assert s.drafted > 0 and 0 <= s.accepted <= s.drafted
    assert s.steps + s.accepted == 20                 # every token after the first: a round's own or a kept guess
    if proposer == "itself":                          # a model agrees with itself: 4 guesses + 1 a round
        assert s.accepted == s.drafted and s.steps == 4


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
def test_rows_decoding_together_check_their_guesses_in_one_forward(arch, backend):
    """Three requests on three rows with prompt lookup (a proposer a request) and speculate_rows 3: their rounds
    run together, one forward over every row's last token and guesses (Engine.verify_rows), the row freed first
    riding along parked; each request gets the tokens it gets alone."""
    model = tiny_model(arch, ops=backend.ops, seed=0, device=backend.device)
    prompts = [REPEATING, [7, 3, 7, 3, 7, 3, 7], [11, 12, 13, 11, 12, 13, 11, 12]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 20, 14)]
    done, _, s = _served(model, list(zip(prompts, params)), PromptLookup(3), max_batch=3, speculate_rows=3)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert list(done[i].token_ids) == _alone(model, p, sp), i
    assert any(key[0] == "rows" for key in s.engine._verify) and s.drafted > 0


class _GuessesForOne:
    """Prompt lookup for sequences that begin with token 5 only: one of four rows guesses."""
    num_draft = 3

    def __init__(self):
        self.lookup = PromptLookup(3)

    def begin(self, engine=None):
        self.lookup.begin(engine)

    def fork(self):
        return _GuessesForOne()

    def propose(self, tokens, k):
        return self.lookup.propose(tokens, k) if tokens[0] == 5 else []


def test_rows_take_a_batched_step_where_fewer_than_half_of_them_guess():
    model = tiny_model("llama", seed=0)
    prompts = [REPEATING, [7, 3, 7, 3, 7, 3, 7], [11, 12, 13, 11, 12, 13], [8, 9, 8, 9, 8, 9]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    done, _, s = _served(model, [(p, params) for p in prompts], _GuessesForOne(), max_batch=4, speculate_rows=4)
    for i, p in enumerate(prompts):
        assert list(done[i].token_ids) == _alone(model, p, params)
    assert not any(key[0] == "rows" for key in s.engine._verify)


@pytest.mark.parametrize("proposer", ["draft", "one_row"])
def test_rounds_wait_for_one_row_with_a_draft_model_or_by_default(proposer):
    """A draft model's one cache follows one sequence (even with speculate_rows 2), and speculate_rows is 1 by
    default: while two requests decode they take batched steps, and rounds resume once one decodes alone."""
    model = tiny_model("llama", seed=0)
    short, long_ = SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=20, ignore_eos=True)
    other = [7, 3, 7, 3, 7, 3, 7]
    make = DraftModel(model, 3) if proposer == "draft" else PromptLookup(3)
    outcomes = Outcomes(2)
    rows = 2 if proposer == "draft" else None
    with Scheduler(Engine(model, max_seq=64, max_batch=2), proposer=make, speculate_rows=rows) as s:
        s.submit(REPEATING, long_, outcomes.listener(0))
        s.submit(other, short, outcomes.listener(1))
        done = outcomes.wait(300)
    assert list(done[0].token_ids) == _alone(model, REPEATING, long_)
    assert list(done[1].token_ids) == _alone(model, other, short)
    assert s.rows_decoded > s.steps                   # some steps decoded both rows
    assert s.drafted > 0 and not any(key[0] == "rows" for key in s.engine._verify)


def test_a_request_whose_guesses_are_wrong_takes_plain_steps_between_fewer_and_fewer_rounds():
    model = tiny_model("llama", seed=0)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    done, _, s = _served(model, [([5, 9, 17, 33], params)], WrongGuesses(), lookahead=True)
    assert list(done[0].token_ids) == _alone(model, [5, 9, 17, 33], params)
    assert s.drafted == 2 * 5 and s.accepted == 0        # rounds at turns 1, 3, 6, 11, 20 of 23


def test_a_round_ends_at_a_stop_token_and_at_max_tokens():
    """A stop token among a round's kept tokens ends the request there (the rest is dropped); a budget that a
    round could overrun is met exactly."""
    model = tiny_model("llama", seed=0)
    plain = _alone(model, REPEATING, SamplingParams(max_tokens=20, ignore_eos=True))
    stop = plain[9]
    params = SamplingParams(max_tokens=20, stop_token_ids=(stop,))
    done, _, _ = _served(model, [(REPEATING, params)], DraftModel(model, 4))
    assert list(done[0].token_ids) == plain[:plain.index(stop) + 1] and done[0].reason == "stop"
    for budget in (2, 5, 7):                          # with 5 tokens a round, these end mid-round
        params = SamplingParams(max_tokens=budget, ignore_eos=True)
        done, _, _ = _served(model, [(REPEATING, params)], DraftModel(model, 4))
        assert list(done[0].token_ids) == plain[:budget] and done[0].reason == "length"


def test_log_probabilities_are_those_of_plain_steps():
    model = tiny_model("qwen3", seed=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain, plain_lp, _ = _served(model, [(REPEATING, params)], None, logprobs=3)
    fast, fast_lp, s = _served(model, [(REPEATING, params)], DraftModel(model, 3), logprobs=3)
    assert fast[0].token_ids == plain[0].token_ids and s.accepted > 0
    assert [e.token for e in fast_lp[0]] == [e.token for e in plain_lp[0]]
    torch.testing.assert_close([e.logprob for e in fast_lp[0]], [e.logprob for e in plain_lp[0]],
                               rtol=1e-4, atol=1e-4)
    assert [[t for t, _ in e.top] for e in fast_lp[0]] == [[t for t, _ in e.top] for e in plain_lp[0]]


def test_seeded_sampling_through_rounds_is_repeatable():
    """Sampled rounds draw from the request's own generator: one seed, the same tokens; another, others."""
    model = tiny_model("llama", seed=0)

    def run(seed):
        params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=seed)
        done, _, s = _served(model, [(REPEATING, params)], PromptLookup(3))
        assert len(done[0].token_ids) == 16
        return list(done[0].token_ids), s.drafted
    tokens, drafted = run(11)
    assert drafted > 0 and run(11) == (tokens, drafted) and run(12)[0] != tokens


def test_the_server_serves_smollm2_with_prompt_lookup(smollm2_path, monkeypatch):
    """A real checkpoint served with prompt lookup, asked to repeat a paragraph: the greedy text of plain
    generation, most guesses kept, and /metrics counting them."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")           # numba kernels, as a CPU server runs them
    from fastapi.testclient import TestClient

    from kilnx.models.loaders import load_model
    from kilnx.runtime.generate import default_stop_ids, generate_text
    from kilnx.runtime.server import Server, create_app
    lm = load_model(smollm2_path, device="cpu", ops="auto")
    para = "The kiln was built in 1887 from local clay bricks and fired pottery until 1952."
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{para}"}]
    plain, _ = generate_text(lm, messages[0]["content"], SamplingParams(max_tokens=24), chat=True)
    scheduler = Scheduler(Engine(lm.model, max_seq=192, max_batch=2), lm.tokenizer,
                          stop_token_ids=default_stop_ids(lm), proposer=PromptLookup(4))
    with TestClient(create_app(Server(lm, scheduler, "smollm2"))) as client:
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == plain
        metrics = client.get("/metrics").text
    scheduler.close()
    assert scheduler.accepted >= 12 and f"kilnx_spec_decode_accepted_tokens_total {scheduler.accepted}.0" in metrics
    assert f"kilnx_spec_decode_draft_tokens_total {scheduler.drafted}.0" in metrics


def test_kilnx_serve_refuses_speculative_flags_that_do_not_go_together(smollm2_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from typer.testing import CliRunner

    from kilnx.cli import app
    for flags, message in ((["--prompt-lookup", "--draft-model", smollm2_path], "not both"),
                           (["--prompt-lookup", "--num-draft-tokens", "0"], "at least 1"),
                           (["--prompt-lookup", "--speculative-max-rows", "0"], "--speculative-max-rows")):
        r = CliRunner().invoke(app, ["serve", "--model", smollm2_path, "--device", "cpu", *flags])
        assert r.exit_code != 0 and message in r.output, r.output
