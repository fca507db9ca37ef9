"""Structured output (runtime/structured.py) on the real SmolLM2-135M checkpoint: the text follows the grammar,
and each token is the model's greedy choice among those the grammar allows there."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("llguidance")
from kilnx.runtime import structured as S  # noqa: E402
from kilnx.runtime.sampling import SamplingParams  # noqa: E402

CAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
       "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served(smollm2_path):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "0")     # numba kernels, not Triton's interpreter (make test's choice)
        from kilnx.models.loaders import load_model
        from kilnx.runtime.engine import Engine
        from kilnx.runtime.generate import default_stop_ids
        from kilnx.runtime.scheduler import Scheduler
        lm = load_model(smollm2_path, device="cpu", ops="auto")
        with Scheduler(Engine(lm.model, max_seq=256, max_batch=2), lm.tokenizer,
                       stop_token_ids=default_stop_ids(lm)) as sched:
            yield lm, sched


def _ask(lm, sched, question, grammar, max_tokens=40):
    tok = lm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False)
    items = list(sched.stream(ids, SamplingParams(max_tokens=max_tokens, grammar=grammar)))
    return ids, "".join(items[:-1]), items[-1]


def test_a_json_schema_is_followed_and_each_token_is_the_best_the_grammar_allows(served):
    lm, sched = served
    ids, text, fin = _ask(lm, sched, "Describe a cat as JSON.", S.json_schema_grammar(CAT))
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)
    assert fin.reason == "stop"
    # the specification: one forward over prompt + output; at each step, the argmax of the logits with what a
    # fresh matcher forbids there at -inf
    from kilnx.runtime.kv_cache import KVCache
    out = list(fin.token_ids)
    seq = ids + out
    logits = lm.model.forward(torch.tensor([seq]), torch.arange(len(seq))[None],
                              KVCache.for_model(lm.config, 1, len(seq) + 1))[0]
    from kilnx.runtime.generate import default_stop_ids
    judge = S.GrammarConstraint(lm.tokenizer, S.json_schema_grammar(CAT), lm.config.vocab_size, default_stop_ids(lm))
    for i, t in enumerate(out):
        allowed = judge.allowed()
        assert allowed[t]
        best = logits[len(ids) - 1 + i].float().masked_fill(~allowed, -torch.inf)
        assert best[t] >= best.max() - 1e-3 * best.abs().max()
        judge.accept(t)
    assert judge.complete


def test_a_choice_and_a_regex(served):
    lm, sched = served
    _, text, fin = _ask(lm, sched, "Is the sky blue? Answer yes or no.", S.choice_grammar(["yes", "no"]))
    assert text in ("yes", "no") and fin.reason == "stop"
    _, text, _ = _ask(lm, sched, "Give me a phone number.", S.regex_grammar(r"[0-9]{3}-[0-9]{4}"))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)


def test_any_json_object_and_side_by_side_with_free_text(served):
    """A constrained request beside a free one: each gets what it gets alone."""
    lm, sched = served
    _, alone_free, _ = _ask(lm, sched, "Say hello.", None, max_tokens=12)
    from outcomes import Outcomes
    tok = lm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in ("Give me a JSON object about a dog.", "Say hello.")]
    outcomes = Outcomes(2)
    sched.submit(prompts[0], SamplingParams(max_tokens=60, grammar=S.json_object_grammar()), outcomes.listener(0))
    sched.submit(prompts[1], SamplingParams(max_tokens=12), outcomes.listener(1))
    done = outcomes.wait(120)
    dog = tok.decode(done[0].token_ids)
    if done[0].reason == "stop":
        assert isinstance(json.loads(dog), dict)
    else:                                       # cut by max_tokens: still a prefix of an object
        assert dog.lstrip().startswith("{")
    assert tok.decode(done[1].token_ids) == alone_free


def test_bad_grammars_are_one_clear_error(served):
    lm, sched = served
    with pytest.raises(S.GrammarError, match="schema"):
        S.json_schema_grammar({"type": "no-such-type"})
    with pytest.raises(S.GrammarError):
        S.choice_grammar([])
    with pytest.raises(S.GrammarError, match="regex"):
        S.regex_grammar("(unclosed")
    with pytest.raises(S.GrammarError, match="grammar cannot be used"):
        sched.submit([1, 2, 3], SamplingParams(grammar="not a grammar"), lambda *e: None)


def test_kilnx_generate_under_a_schema_or_a_regex(smollm2_path, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from kilnx.cli import app
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    schema = tmp_path / "dog.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
                                  "additionalProperties": False}))
    base = ["generate", "--model", smollm2_path, "--device", "cpu", "--max-tokens", "30"]
    r = CliRunner().invoke(app, base + ["--chat", "--prompt", "Name a dog, as JSON.", "--json-schema", str(schema)])
    assert r.exit_code == 0, r.output
    assert list(json.loads(r.stdout)) == ["name"]
    r = CliRunner().invoke(app, base + ["--prompt", "My phone number is", "--regex", " [0-9]{3}-[0-9]{4}"])
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}\n", r.stdout)
    r = CliRunner().invoke(app, base + ["--prompt", "x", "--regex", "("])
    assert r.exit_code == 1 and "regex cannot be used" in r.stderr
    r = CliRunner().invoke(app, base + ["--prompt", "x", "--json-schema", "{nope"])
    assert r.exit_code == 1 and "neither a file nor JSON" in r.stderr
