"""Speculative decoding (runtime/speculative.py): what the proposers guess, that a round keeps tokens with the
model's own distribution, and that generation with guesses gives the tokens it gives without them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kilnx.runtime.engine import Engine
from kilnx.runtime.generate import GenerationStats, generate_ids
from kilnx.runtime.sampling import Sampler, SamplingParams
from kilnx.runtime.speculative import DraftModel, Pacing, PromptLookup, accept, check_draft
from tests.runtime.tiny_models import WrongGuesses, tiny_model


def _latest_continuation(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The specification of prompt lookup, by brute force."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=200, deadline=None)
@given(seq=st.lists(st.integers(0, 4), min_size=1, max_size=40), grow=st.lists(st.integers(0, 4), max_size=10),
       k=st.integers(1, 5), max_n=st.integers(1, 4))
def test_prompt_lookup_guesses_what_followed_the_latest_earlier_occurrence_of_the_last_tokens(seq, grow, k, max_n):
    """Longest n-gram first; the index grows with the sequence, and `begin` starts another."""
    lookup = PromptLookup(k, max_ngram=max_n)
    assert lookup.propose(seq, k) == _latest_continuation(seq, k, max_n, 1)
    longer = seq + grow
    assert lookup.propose(longer, k) == _latest_continuation(longer, k, max_n, 1)
    other = list(reversed(longer))
    lookup.begin()
    assert lookup.propose(other, k) == _latest_continuation(other, k, max_n, 1)


def test_prompt_lookup_examples():
    lookup = PromptLookup(3, max_ngram=2)
    assert lookup.propose([5, 6, 7, 8, 9, 5, 6], 3) == [7, 8, 9]
    lookup.begin()
    assert lookup.propose([1, 2, 3], 3) == []
    lookup.begin()
    assert lookup.propose([4, 1, 4, 2, 9, 4, 2], 3) == [9, 4, 2]           # "4 2" before "4"
    with pytest.raises(ValueError, match="num_draft"):
        PromptLookup(0)


def test_greedy_rounds_keep_guesses_while_they_are_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    sampler = Sampler(SamplingParams())
    assert accept(sampler, logits, [1, 0, 2]) == [1, 0, 2, 0]              # all kept, and the model's next
    assert accept(sampler, logits, [1, 2, 2]) == [1, 0]                    # the second corrected, round over
    assert accept(sampler, logits[:1], []) == [1]


def test_sampled_rounds_keep_the_models_distribution():
    """Over many rounds with two guesses, the first two tokens kept are distributed as the model's p1 x p2,
    whatever was guessed — a guess is kept with p(guess), else the token comes from p without it."""
    torch.manual_seed(0)
    logits = torch.randn(3, 4) * 1.5
    p = torch.softmax(logits, dim=-1)
    for draft in ([0, 1], [3, 3]):
        counts = torch.zeros(4, 4)
        trials = 12000
        sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
        for _ in range(trials):
            kept = accept(sampler, logits, draft)
            if len(kept) == 1:                             # the second position's token: its own draw
                kept = kept + [int(torch.multinomial(p[1], 1, generator=sampler.gen))]
            counts[kept[0], kept[1]] += 1
        joint = p[0][:, None] * p[1][None, :]
        assert (counts / trials - joint).abs().max() < 0.015, (draft, counts / trials, joint)


def test_sampled_rounds_respect_the_samplers_filters():
    """top_k = 1 leaves one token: a guess of another is never kept."""
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    sampler = Sampler(SamplingParams(temperature=0.8, top_k=1, seed=3))
    for _ in range(50):
        assert accept(sampler, logits, [2]) == [1]
        assert accept(sampler, logits, [1]) == [1, 0]


def _tokens(engine: Engine, ids, params, proposer=None) -> tuple[list[int], GenerationStats]:
    *toks, stats = generate_ids(engine, ids, params, proposer=proposer)
    return toks, stats


def test_speculation_gives_the_tokens_of_plain_decoding(backend):
    """Greedy, with guesses from prompt lookup (often right on a repeating prompt) and from another random model
    (mostly wrong): the tokens equal plain greedy decoding's; the same seed gives the same sampled tokens."""
    target = tiny_model("llama", ops=backend.ops, seed=0, device=backend.device)
    draft = tiny_model("llama", ops=backend.ops, seed=1, device=backend.device)
    prompt = [5, 9, 17, 33, 5, 9, 17, 33, 5, 9]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    plain, _ = _tokens(Engine(target, max_seq=48), prompt, greedy)
    for proposer in (PromptLookup(3), DraftModel(draft, 3), DraftModel(target, 4)):
        got, stats = _tokens(Engine(target, max_seq=48), prompt, greedy, proposer)
        assert got == plain, type(proposer).__name__
        assert stats.drafted > 0 and 0 <= stats.accepted <= stats.drafted
    _, selfdraft = _tokens(Engine(target, max_seq=48), prompt, greedy, DraftModel(target, 4))
    assert selfdraft.accepted == selfdraft.drafted                     # a model agrees with itself
    sampled = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=7, repetition_penalty=1.3)
    once, _ = _tokens(Engine(target, max_seq=48), prompt, sampled, PromptLookup(3))
    again, _ = _tokens(Engine(target, max_seq=48), prompt, sampled, PromptLookup(3))
    assert once == again and len(once) == 16


def test_a_verify_forward_gives_every_guess_its_logits_and_replays_on_the_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")           # the numba lowering, whose launches replay
    target = tiny_model("qwen3", ops="kilnx", seed=2)
    prompt, guesses = [3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5]
    reference = Engine(target, max_seq=32).prefill_logits(prompt + guesses)[len(prompt) - 1:]
    engine = Engine(target, max_seq=32)
    engine.prefill(prompt[:-1])
    for _ in range(3):                          # eager, then recorded, then replayed
        got = engine.verify([prompt[-1], *guesses], start=len(prompt) - 1)
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    assert engine._verify[(0, 4)].graph is not None


def test_a_draft_must_share_the_targets_tokenizer(smollm2_path):
    from types import SimpleNamespace

    from kilnx.models.loaders import load_model
    lm = load_model(smollm2_path)
    check_draft(lm, lm)
    other = SimpleNamespace(config=SimpleNamespace(vocab_size=256), tokenizer=None, source="tiny")
    with pytest.raises(ValueError, match="does not share"):
        check_draft(lm, other)


def test_speculation_with_a_grammar_is_refused():
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="does not take a grammar"):
        _tokens(Engine(target, max_seq=32), [1, 2], SamplingParams(grammar="start: 'a'"), PromptLookup(2))


def test_prompt_lookup_on_smollm2_keeps_the_greedy_text(smollm2_path, monkeypatch):
    """A real checkpoint asked to repeat a paragraph: prompt lookup's guesses are mostly kept and the text is
    plain greedy decoding's; the CLI's --prompt-lookup says how many guesses it kept."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")           # numba kernels, as the CLI on a CPU runs them
    from typer.testing import CliRunner

    from kilnx.cli import app
    from kilnx.models.loaders import load_model
    from kilnx.runtime.generate import stream
    lm = load_model(smollm2_path)
    para = "The kiln was built in 1887 from local clay bricks and fired pottery until 1952."
    prompt = f"Repeat this text exactly:\n\n{para}"
    params = SamplingParams(max_tokens=24)
    plain = [x for x in stream(lm, prompt, params, chat=True)]
    fast = [x for x in stream(lm, prompt, params, chat=True, proposer=PromptLookup(4))]
    assert fast[-1].token_ids == plain[-1].token_ids
    assert fast[-1].accepted >= fast[-1].generated_tokens // 2
    r = CliRunner().invoke(app, ["generate", "--model", smollm2_path, "--prompt", prompt, "--chat", "--max-tokens",
                                 "24", "--prompt-lookup", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "".join(x for x in plain if isinstance(x, str)) in r.stdout and "guesses kept" in r.output
    r = CliRunner().invoke(app, ["generate", "--model", smollm2_path, "--prompt", "x", "--prompt-lookup",
                                 "--draft-model", smollm2_path])
    assert r.exit_code != 0 and "not both" in r.output


def test_pacing_sends_a_sequence_of_wrong_guesses_to_plain_steps_for_longer_and_longer():
    """Rounds that keep nothing: 1, 2, 4, ... plain steps between them (up to 64); rounds that keep their guesses
    bring the rate back over min_rate and rounds every turn."""
    pace, turns = Pacing(min_rate=0.5), []
    for _ in range(40):
        if pace.ready():
            turns.append("round")
            pace.record(4, 0)
        else:
            turns.append("step")
    rounds = [i for i, t in enumerate(turns) if t == "round"]
    assert [b - a - 1 for a, b in zip(rounds, rounds[1:])] == [1, 2, 4, 8, 16]
    while not pace.ready():
        pass
    for _ in range(6):                      # guesses kept: the estimate recovers
        pace.record(4, 4)
    assert pace.rate >= 0.5 and pace.ready() and pace.wait == 1
    pace.record(4, 3)                       # mostly kept: a round still ends with a rejection, rate stays high
    assert pace.ready()


def test_wrong_guesses_cost_a_few_rounds_not_one_a_token(backend):
    target = tiny_model("llama", ops=backend.ops, seed=0, device=backend.device)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    plain, _ = _tokens(Engine(target, max_seq=48), [5, 9, 17, 33], greedy)
    assert 255 not in plain
    got, stats = _tokens(Engine(target, max_seq=48), [5, 9, 17, 33], greedy, WrongGuesses())
    assert got == plain and stats.accepted == 0
    assert stats.drafted == 2 * 5                 # rounds at turns 1, 3, 6, 11, 20 of 23
