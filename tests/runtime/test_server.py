"""`kilnx serve`'s OpenAI-compatible API on the real SmolLM2-135M checkpoint (CPU): what a client of OpenAI's
API gets, the same text `kilnx generate` writes, and one clear 400 for what the server cannot honour."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kilnx.runtime.sampling import SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def served(smollm2_path):
    # the kernels through numba, as a CPU server runs them: `make test`'s TRITON_INTERPRET=1 would send them
    # through Triton's interpreter (a decode step in minutes)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "0")
        yield from _served(smollm2_path)


def _served(smollm2_path):
    from kilnx.models.loaders import load_model
    from kilnx.runtime.engine import Engine
    from kilnx.runtime.generate import default_stop_ids
    from kilnx.runtime.scheduler import Scheduler
    from kilnx.runtime.server import Server, create_app
    lm = load_model(smollm2_path, device="cpu", ops="auto")
    scheduler = Scheduler(Engine(lm.model, max_seq=192, max_batch=4), lm.tokenizer, stop_token_ids=default_stop_ids(lm),
                          prefix_slots=2)
    with TestClient(create_app(Server(lm, scheduler, "smollm2"))) as client:
        yield lm, client
    scheduler.close()


def _alone(lm, prompt, n, chat=False):
    from kilnx.runtime.generate import generate_text
    text, stats = generate_text(lm, prompt, SamplingParams(max_tokens=n), chat=chat)
    return text, stats


def _events(response):
    lines = [ln for ln in response.text.split("\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_completions_greedy_text_is_generates_text(served):
    lm, client = served
    r = client.post("/v1/completions", json={"model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 8,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    text, stats = _alone(lm, PROMPTS[0], 8)
    assert body["object"] == "text_completion" and body["model"] == "smollm2"
    assert body["choices"][0]["text"] == text
    assert body["choices"][0]["finish_reason"] == ("length" if stats.stop_reason == "max_tokens" else "stop")
    usage = dict(body["usage"])
    assert usage.pop("prompt_tokens_details")["cached_tokens"] >= 0
    assert usage == {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
                     "total_tokens": stats.prompt_tokens + stats.generated_tokens}
    # min_p 1 leaves only the likeliest token at each step: sampling at any temperature is greedy decoding
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.5, "min_p": 1.0,
                                             "seed": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text


def test_several_prompts_decode_side_by_side_each_as_alone(served):
    lm, client = served
    r = client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["text"] for c in choices] == [_alone(lm, p, 6)[0] for p in PROMPTS]


def test_a_streamed_completion_is_the_same_text_in_pieces(served):
    lm, client = served
    body = {"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = _events(r)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == _alone(lm, PROMPTS[2], 10)[0]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == "length" and set(finals[:-1]) == {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_chat_completion_uses_the_chat_template(served):
    lm, client = served
    msg = "What is 2 + 2?"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": msg}],
                                                  "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == _alone(lm, msg, 12, chat=True)[0]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": msg}],
                                                  "max_completion_tokens": 12, "temperature": 0, "stream": True})
    chunks = _events(r)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == choice["message"]["content"]


def test_a_stop_string_ends_the_text_before_it(served):
    lm, client = served
    full, _ = _alone(lm, PROMPTS[1], 24)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop and stop in full
    for stream in (False, True):
        r = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0,
                                                 "stop": [stop], "stream": stream})
        if stream:
            chunks = _events(r)
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert text == full[:full.index(stop)] and reason == "stop"


def test_token_id_prompts_and_seeded_sampling(served):
    lm, client = served
    ids = lm.tokenizer.encode(PROMPTS[0])
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0.9, "top_k": 40, "seed": 7}
    a, b = (client.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2))
    assert a == b
    assert client.post("/v1/completions", json={**body, "prompt": PROMPTS[0]}).json()["choices"][0]["text"] == a


def test_a_logit_bias_forces_or_bans_tokens(served):
    """OpenAI's logit_bias: +100 on one token makes greedy choose it at every step; -100 on the greedy first
    token makes the model's second choice come first."""
    lm, client = served
    forced = lm.tokenizer.encode(" Paris")[0]
    body = {"prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "logprobs": 0}
    r = client.post("/v1/completions", json={**body, "logit_bias": {str(forced): 100}}).json()
    assert r["choices"][0]["logprobs"]["tokens"] == [lm.tokenizer.decode([forced])] * 3
    plain = client.post("/v1/completions", json={**body, "logprobs": 2}).json()["choices"][0]["logprobs"]
    from kilnx.runtime.engine import Engine
    from kilnx.runtime.generate import generate_ids
    first = next(generate_ids(Engine(lm.model, max_seq=96), lm.tokenizer.encode(PROMPTS[1]),
                              SamplingParams(max_tokens=1)))
    assert lm.tokenizer.decode([first]) == plain["tokens"][0]
    banned = client.post("/v1/completions", json={**body, "logprobs": 2, "logit_bias": {str(first): -100}}).json()
    second = [t for t in plain["top_logprobs"][0] if t != plain["tokens"][0]]
    assert banned["choices"][0]["logprobs"]["tokens"][0] == max(second, key=plain["top_logprobs"][0].get)


def test_structured_output_through_both_apis(served):
    """OpenAI's response_format (json_schema, json_object) on chat, vLLM's guided_choice on completions,
    streamed or not: the text follows the grammar."""
    pytest.importorskip("llguidance")
    _, client = served
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    msgs = [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 30, "temperature": 0,
                                                  "response_format": {"type": "json_schema",
                                                                      "json_schema": {"name": "c", "schema": schema}}})
    assert r.status_code == 200, r.text
    answer = json.loads(r.json()["choices"][0]["message"]["content"])
    assert list(answer) == ["city"] and isinstance(answer["city"], str)
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 40, "temperature": 0.7, "seed": 3,
                                                  "stream": True, "response_format": {"type": "json_object"}})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in _events(r) if e["choices"])
    assert text.lstrip().startswith("{")
    r = client.post("/v1/completions", json={"prompt": "Is Paris in France? Answer:", "max_tokens": 5,
                                             "guided_choice": ["yes", "no"], "n": 2, "temperature": 1.0})
    assert [c["text"] for c in r.json()["choices"]] in ([a, b] for a in ("yes", "no") for b in ("yes", "no"))


def test_tokenize_detokenize_and_extra_stop_tokens(served):
    lm, client = served
    r = client.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert r["tokens"] == lm.tokenizer.encode(PROMPTS[0]) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 192
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == lm.tokenizer.encode_chat("Hi")
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == PROMPTS[0]
    assert client.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert client.post("/tokenize", json={"messages": "hi"}).status_code == 400
    # vLLM's stop_token_ids: the greedy answer's third token ends it
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "logprobs": 0}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]
    third = lm.tokenizer.encode(PROMPTS[0] + "".join(plain["logprobs"]["tokens"][:3]))[-1]
    cut = client.post("/v1/completions", json={**body, "stop_token_ids": [third]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and len(cut["logprobs"]["tokens"]) < len(plain["logprobs"]["tokens"])
    assert client.post("/v1/completions", json={**body, "stop_token_ids": [10 ** 7]}).status_code == 400


def test_best_of_returns_the_samples_with_the_highest_mean_log_probability(served):
    """best_of 4, n 2: the same four seeded samples as n 4 gives, the two with the highest mean token
    log-probability, best first; usage counts all four."""
    _, client = served
    body = {"prompt": PROMPTS[2], "max_tokens": 6, "temperature": 1.0, "seed": 11}
    every = client.post("/v1/completions", json={**body, "n": 4, "logprobs": 0}).json()
    mean = {c["text"]: sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"])
            for c in every["choices"]}
    best = client.post("/v1/completions", json={**body, "n": 2, "best_of": 4}).json()
    assert [c["text"] for c in best["choices"]] == sorted(mean, key=mean.get, reverse=True)[:2]
    assert [c["index"] for c in best["choices"]] == [0, 1] and best["choices"][0]["logprobs"] is None
    assert best["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}


def test_a_forced_tool_call_comes_back_as_tool_calls(served):
    """tool_choice "required" (or a named function): the answer is constrained to a call of a given tool and
    returned as OpenAI's tool_calls, whole and streamed; the conversation then goes on with the tool's result."""
    pytest.importorskip("llguidance")
    _, client = served
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"messages": msgs, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 40, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert call["function"]["name"] == "get_weather" and isinstance(json.loads(call["function"]["arguments"])["city"], str)
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "stream": True}
    events = _events(client.post("/v1/chat/completions", json=named))
    deltas = [e["choices"][0] for e in events if e["choices"]]
    streamed = [d["delta"]["tool_calls"][0] for d in deltas if "tool_calls" in d["delta"]]
    assert streamed[0]["function"]["name"] == "get_weather" and streamed[0]["id"].startswith("call_")
    assert len(streamed) > 1 and all("id" not in s and "name" not in s["function"] for s in streamed[1:])  # as written
    assert "".join(s["function"]["arguments"] for s in streamed) == call["function"]["arguments"]
    assert deltas[-1]["finish_reason"] == "tool_calls" and not any(d["delta"].get("content") for d in deltas)
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 24 C"}]
    r = client.post("/v1/chat/completions", json={"messages": follow, "tools": [WEATHER], "tool_choice": "none",
                                                  "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] and "tool_calls" not in r.json()["choices"][0]["message"]


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": 3, "best_of": 2}, 400, "at least n"),
    ({"prompt": "hi", "best_of": 2, "stream": True}, 400, "cannot be streamed"),
    ({"prompt": "hi", "logprobs": 30}, 400, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ({"prompt": "hi", "logit_bias": {"five": 1}}, 400, "token ids"),
    ({"prompt": "hi", "response_format": {"type": "yaml"}}, 400, "not one of text"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "json_schema.schema"),
    ({"prompt": "hi", "guided_regex": "(unclosed"}, 400, "regex cannot be used"),
    ({"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, 400, "not several"),
    ({"prompt": "hi", "functions": [{"name": "f"}]}, 400, "`functions`"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "[-100, 100]"),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "this model has 49152"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "serves `smollm2`"),
    ({"prompt": "hi " * 250}, 400, "shorten the prompt"),
    ({"prompt": "hi", "max_tokens": 500}, 400, "lower max_tokens"),
    ({"prompt": [1, 2, 10**9]}, 400, "token ids must lie in"),
    ({"prompt": []}, 400, "empty"),
    ({"max_tokens": 3}, 400, "prompt"),
])
def test_what_the_server_cannot_honour_is_one_clear_error(served, body, status, words):
    _, client = served
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_models_and_health(served):
    _, client = served
    assert client.get("/health").json() == {"status": "ok"}
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["smollm2"] and data[0]["max_model_len"] == 192
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kilnx_serve_answers_over_http(served, tmp_path):
    """The `kilnx serve` command itself: a process listening on a port, answering six clients at once (three
    prompts, streamed and not, decoded side by side on two rows) with the text the in-process server gives."""
    import os
    import subprocess
    import sys
    import threading
    import time
    import urllib.request
    lm, client = served
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    template = tmp_path / "plain.jinja"       # --chat-template: a template of our own instead of the checkpoint's
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    proc = subprocess.Popen([sys.executable, "-m", "kilnx.cli", "serve", "--model", "smollm2-135m", "--device", "cpu",
                             "--port", str(port), "--max-seq", "96", "--max-batch", "2",
                             "--chat-template", str(template)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TRITON_INTERPRET": "0"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()
                time.sleep(0.5)
        # several clients at once, streaming and not: each gets what it gets alone from the in-process server
        bodies = [{"model": "smollm2-135m", "prompt": p, "max_tokens": 8, "temperature": 0, "stream": stream}
                  for p in PROMPTS for stream in (False, True)]
        got = [None] * len(bodies)

        def ask(i):
            req = urllib.request.Request(url + "/v1/completions", data=json.dumps(bodies[i]).encode(),
                                         headers={"Content-Type": "application/json"})
            raw = urllib.request.urlopen(req, timeout=300).read().decode()
            if bodies[i]["stream"]:
                chunks = [json.loads(ln[6:]) for ln in raw.split("\n") if ln.startswith("data: {")]
                got[i] = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            else:
                got[i] = json.loads(raw)["choices"][0]["text"]
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for body, text in zip(bodies, got):
            want = client.post("/v1/completions", json={**body, "model": "smollm2", "stream": False}).json()
            assert text == want["choices"][0]["text"] != ""
        req = urllib.request.Request(url + "/tokenize", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode())
        ids = json.loads(urllib.request.urlopen(req, timeout=60).read())["tokens"]
        assert ids == lm.tokenizer.encode("user: Hi\nassistant:", add_special_tokens=False)
    finally:
        proc.terminate()
        proc.wait(60)


def test_kilnx_serve_refuses_bad_input_in_one_line():
    from typer.testing import CliRunner

    from kilnx.runtime.cli import app
    for args, says in ((["--model", "no-such-model"], "no-such-model"), (["--model", "smollm2-135m", "--max-batch", "0"],
                                                                         "--max-batch must be at least 1")):
        r = CliRunner().invoke(app, ["serve", "--device", "cpu", *args])
        out = r.output.strip()
        assert r.exit_code == 1 and out.startswith("error:") and says in out and "Traceback" not in out


def test_a_chats_next_turn_reuses_the_cache_of_the_first(served):
    lm, client = served
    from kilnx.runtime.generate import generate_text
    messages = [{"role": "user", "content": "Name a color."}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    reply = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    messages = messages + [reply, {"role": "user", "content": "And another?"}]
    r = client.post("/v1/chat/completions", json={**body, "messages": messages}).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 10
    ids = lm.tokenizer.encode(lm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert r["choices"][0]["message"]["content"] == generate_text(lm, ids, SamplingParams(max_tokens=8))[0]


def _model_logprobs(lm, ids):
    """log-softmax of one forward over ids: row j scores token j + 1."""
    import torch

    from kilnx.runtime.kv_cache import KVCache
    cache = KVCache.for_model(lm.config, 1, len(ids), dtype=lm.model.dtype, device="cpu")
    logits = lm.model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0]
    return torch.log_softmax(logits.double(), -1)


def test_echo_with_logprobs_scores_the_prompt_as_a_loglikelihood_request(served):
    """What evaluation harnesses send (max_tokens 0, echo, logprobs 1): the prompt back as text, with each of
    its tokens' log-probability under the model (the first has none) and the most likely token there."""
    lm, client = served
    prompt = "The capital of France is Paris"
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    ids = lm.tokenizer.encode(prompt)
    assert choice["text"] == prompt and len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert lp["tokens"] == [lm.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    want = _model_logprobs(lm, ids)
    for j in range(1, len(ids)):
        assert abs(lp["token_logprobs"][j] - float(want[j - 1, ids[j]])) < 2e-3
        (best, value), = lp["top_logprobs"][j].items()
        assert abs(value - float(want[j - 1].max())) < 2e-3
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])


def test_logprobs_of_generated_tokens_completions_and_chat(served):
    lm, client = served
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 6, "logprobs": 2,
                                             "temperature": 0, "ignore_eos": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == r["choices"][0]["text"] and len(lp["token_logprobs"]) == 6
    assert all(len(t) == 2 and max(t.values()) == pytest.approx(v, abs=1e-6)       # greedy: the token is the top
               for t, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
    ids = lm.tokenizer.encode(PROMPTS[0])
    seq = ids + [lm.tokenizer.encode(t, add_special_tokens=False)[0] for t in lp["tokens"][:1]]
    assert lp["token_logprobs"][0] == pytest.approx(float(_model_logprobs(lm, seq)[len(ids) - 1, seq[-1]]), abs=2e-3)
    streamed = _events(client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 6, "logprobs": 2,
                                                            "temperature": 0, "ignore_eos": True, "stream": True}))
    got = [v for c in streamed if c["choices"] and c["choices"][0]["logprobs"]
           for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert got == pytest.approx(lp["token_logprobs"], abs=1e-6)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                                                  "temperature": 0, "logprobs": True, "top_logprobs": 3}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == r["choices"][0]["message"]["content"]
    assert all(len(e["top_logprobs"]) == 3 and e["bytes"] == list(e["token"].encode()) for e in content)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 3})
    assert r.status_code == 400 and "needs `logprobs`" in r.json()["error"]["message"]


def test_an_api_key_guards_the_v1_routes(served):
    from kilnx.runtime.server import Server, create_app
    lm, client = served
    keyed = TestClient(create_app(Server(lm, client.app.state.server.scheduler, "smollm2", api_key="sesame")))
    body = {"prompt": "hi", "max_tokens": 1, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = keyed.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert keyed.get("/health").status_code == 200
    assert keyed.post("/v1/completions", json=body, headers={"Authorization": "Bearer sesame"}).status_code == 200


def test_metrics_count_what_was_served(served):
    """/metrics in Prometheus' text format: finished requests by reason, tokens, first-token and request
    latency histograms, the scheduler's steps and rows (their ratio: the mean batch)."""
    from prometheus_client.parser import text_string_to_metric_families
    _, client = served

    def scrape():
        text = client.get("/metrics").text
        return {s.name + str(sorted(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}
    before = scrape()
    r = client.post("/v1/completions", json={"prompt": PROMPTS[:2], "max_tokens": 5, "temperature": 0,
                                             "ignore_eos": True}).json()
    after = scrape()

    def grew(name):
        return after.get(name, 0) - before.get(name, 0)
    assert grew("kilnx_generation_tokens_total[]") == 10 == r["usage"]["completion_tokens"]
    assert grew("kilnx_prompt_tokens_total[]") == r["usage"]["prompt_tokens"]
    assert grew("kilnx_requests_total[('reason', 'length')]") == 2
    assert grew("kilnx_time_to_first_token_seconds_count[]") == 2 and grew("kilnx_request_seconds_count[]") == 2
    assert grew("kilnx_decode_rows_total[]") == 8 and 4 <= grew("kilnx_decode_steps_total[]") <= 8
    assert after["kilnx_requests_running[]"] == 0 and after["kilnx_requests_waiting[]"] == 0
    assert "kilnx_prefix_store_saves_total[]" in after and "kilnx_prefix_store_loads_total[]" in after


def test_n_choices_a_prompt_each_with_its_own_seed(served):
    """n samples of each prompt, decoded side by side: choice i * n + j is prompt i's j-th, drawn with seed + j,
    the same as a request of one choice with that seed."""
    _, client = served
    body = {"prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 1.0, "seed": 40, "n": 3, "ignore_eos": True}
    r = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == list(range(6)) and r["usage"]["completion_tokens"] == 36
    for c in r["choices"]:
        prompt, j = PROMPTS[c["index"] // 3], c["index"] % 3
        one = client.post("/v1/completions", json={**body, "prompt": prompt, "n": 1, "seed": 40 + j}).json()
        assert one["choices"][0]["text"] == c["text"]
    chunks = _events(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "seed": 1, "stream": True}))
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")) == [0, 1]
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]) == [0, 1]
