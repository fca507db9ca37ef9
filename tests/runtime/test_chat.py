"""`kilnx chat` on the real SmolLM2-135M checkpoint (CPU): each turn answers as `kilnx generate --chat` would
answer the conversation so far, and prefills only what is new."""

from __future__ import annotations

import pytest

from kilnx.models.errors import ModelError
from kilnx.runtime.request import Finished
from kilnx.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    # the kernels through numba, as a CPU chat runs them (not Triton's interpreter, which make test selects)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "0")
        from kilnx.models.loaders import load_model
        yield load_model(smollm2_path, device="cpu", ops="auto")


def _conversation(lm, max_seq=256, max_tokens=10):
    from kilnx.runtime.chat import Conversation
    from kilnx.runtime.engine import Engine
    from kilnx.runtime.generate import default_stop_ids
    from kilnx.runtime.scheduler import Scheduler
    sched = Scheduler(Engine(lm.model, max_seq=max_seq), lm.tokenizer, stop_token_ids=default_stop_ids(lm))
    return sched, Conversation(lm, sched, SamplingParams(max_tokens=max_tokens))


def _say(talk, text):
    items = list(talk.reply(text))
    return "".join(items[:-1]), items[-1]


def test_each_turn_answers_the_whole_conversation_and_reuses_the_last(smollm2):
    from kilnx.runtime.generate import generate_ids, stream
    lm = smollm2
    sched, talk = _conversation(lm)
    with sched:
        text1, fin1 = _say(talk, "What is the capital of France?")
        text2, fin2 = _say(talk, "And of Italy?")
    alone = "".join(p for p in stream(lm, "What is the capital of France?", SamplingParams(max_tokens=10), chat=True)
                    if isinstance(p, str))
    assert text1 == alone and fin1.cached_tokens == 0
    # the second turn's prompt: the template over both turns; its tokens, greedy, as a fresh prefill gives them
    ids = lm.tokenizer.encode(lm.tokenizer.apply_chat_template(talk.messages[:3]), add_special_tokens=False)
    assert fin2.prompt_tokens == len(ids)
    assert fin2.cached_tokens >= fin1.prompt_tokens          # the first turn's prompt at least came from the row
    from kilnx.runtime.engine import Engine
    fresh = [t for t in generate_ids(Engine(lm.model, max_seq=256), ids,
                                     SamplingParams(max_tokens=10, stop_token_ids=fin2.token_ids[-1:]))
             if isinstance(t, int)]
    assert list(fin2.token_ids) == fresh
    assert talk.messages[1] == {"role": "assistant", "content": text1}


def test_the_oldest_turns_go_when_the_conversation_outgrows_the_context(smollm2):
    sched, talk = _conversation(smollm2, max_seq=120, max_tokens=8)
    with sched:
        for i in range(4):
            _, fin = _say(talk, f"Tell me fact number {i} about the sea, in detail please, thank you.")
            assert isinstance(fin, Finished) and fin.prompt_tokens + 8 <= 120
    assert talk.dropped >= 1 and talk.messages[-2]["content"].startswith("Tell me fact number 3")


def test_a_model_without_a_chat_template_is_one_clear_error():
    from kilnx.runtime.chat import Conversation

    class NoTemplate:
        tokenizer, source = None, "tiny.gguf"
    with pytest.raises(ModelError, match="no chat template"):
        Conversation(NoTemplate(), None, SamplingParams())


def test_kilnx_chat_in_the_terminal(smollm2_path, monkeypatch):
    from typer.testing import CliRunner

    from kilnx.cli import app
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    r = CliRunner().invoke(app, ["chat", "--model", smollm2_path, "--device", "cpu", "--max-tokens", "8",
                                 "--max-seq", "256"], input="Hi there!\n/reset\nHi there!\n/exit\n")
    assert r.exit_code == 0, r.output
    replies = [ln for ln in r.stdout.split(">>> ") if ln.strip()]
    assert len(replies) == 2 and replies[0] == replies[1]          # /reset: the same first turn again
    assert "prompt tokens reused]" in r.stderr
    fast = CliRunner().invoke(app, ["chat", "--model", smollm2_path, "--device", "cpu", "--max-tokens", "8",
                                    "--max-seq", "256", "--prompt-lookup", "--min-p", "0.05"], input="Hi there!\n")
    assert fast.exit_code == 0, fast.output
    assert [ln for ln in fast.stdout.split(">>> ") if ln.strip()] == replies[:1]   # greedy: the same reply


def test_kilnx_generate_with_a_system_prompt_and_the_prompt_from_stdin(smollm2, smollm2_path, monkeypatch):
    """--system-prompt puts a system message before the prompt in the chat template (and implies --chat);
    --prompt - reads the prompt from standard input (mlx-lm's convention)."""
    from typer.testing import CliRunner

    from kilnx.cli import app
    from kilnx.runtime.generate import generate_text
    from kilnx.runtime.sampling import SamplingParams
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    system, prompt = "Answer in French.", "What is the capital of Italy?"
    ids = smollm2.tokenizer.encode_chat(prompt, system)
    assert system in smollm2.tokenizer.decode(ids) and system not in smollm2.tokenizer.decode(
        smollm2.tokenizer.encode_chat(prompt))
    want, _ = generate_text(smollm2, ids, SamplingParams(max_tokens=10))
    r = CliRunner().invoke(app, ["generate", "--model", smollm2_path, "--device", "cpu", "--max-tokens", "10",
                                 "--system-prompt", system, "--prompt", "-"], input=prompt)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == want.strip()
