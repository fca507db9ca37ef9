"""Tool calls (runtime/tools.py): which mode a request asks for, how a finished answer's calls are read, and
how tools reach a template that does not know them."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from kilnx.runtime.openai_api import APIError  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402
from kilnx.runtime.tools import CallReader, call_schema, merge_deltas, mode_of, parse, template_messages  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time"}}


def test_the_mode_a_request_asks_for():
    assert mode_of(None, None) == ("none", [])
    assert mode_of([WEATHER, TIME], None) == ("auto", [WEATHER, TIME])
    assert mode_of([WEATHER, TIME], "required") == ("forced", [WEATHER, TIME])
    assert mode_of([WEATHER, TIME], {"type": "function", "function": {"name": "time"}}) == ("forced", [TIME])
    for tools, choice, words in [(None, "required", "needs `tools`"), ([], None, "non-empty"),
                                 ([{"type": "function"}], None, "each tool"),
                                 ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among"),
                                 ([WEATHER], "sometimes", "none, auto, required")]:
        with pytest.raises(APIError, match=words):
            mode_of(tools, choice)


def test_calls_are_read_from_a_finished_answer():
    content, calls = parse('{"name": "weather", "arguments": {"city": "Paris"}}', "forced", [WEATHER])
    assert content is None and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "weather", "arguments": json.dumps({"city": "Paris"})}
    assert parse('{"name": "weath', "forced", [WEATHER]) == ('{"name": "weath', [])       # cut by max_tokens
    cut = parse('{"name": "weather", "arguments": {"ci', "forced", [WEATHER])            # cut in its arguments
    assert cut[0] is None and cut[1][0]["function"] == {"name": "weather", "arguments": '{"ci'}
    text = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call><tool_call>{"name": "time"}</tool_call>')
    content, calls = parse(text, "auto", [WEATHER, TIME])
    assert [c["function"]["name"] for c in calls] == ["weather", "time"]
    assert content == 'Let me look.\n\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'  # not a tool
    assert parse("No calls here.", "auto", [WEATHER]) == ("No calls here.", [])
    content, calls = parse('<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}', "auto", [WEATHER])
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}      # Llama 3.1
    content, calls = parse('Sure.[TOOL_CALLS][{"name": "time", "arguments": {}}, {"name": "weather", '
                           '"arguments": {"city": "Rome"}}]', "auto", [WEATHER, TIME])                # Mistral
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["time", "weather"]
    assert parse('{"name": "other", "parameters": {}}', "auto", [WEATHER])[1] == []                # not a tool
    assert parse('{"city": "Oslo"}', "auto", [WEATHER]) == ('{"city": "Oslo"}', [])
    assert parse("<tool_call>{}</tool_call>", "none", [WEATHER]) == ("<tool_call>{}</tool_call>", [])


def test_one_tool_or_any_of_several_is_the_forced_schema():
    one = call_schema([WEATHER])
    assert one["properties"]["name"] == {"const": "weather"} and one["properties"]["arguments"]["required"] == ["city"]
    assert [o["properties"]["name"]["const"] for o in call_schema([WEATHER, TIME])["anyOf"]] == ["weather", "time"]
    assert call_schema([TIME])["properties"]["arguments"] == {"type": "object"}


def test_a_template_without_tools_gets_them_in_a_system_message_and_calls_in_hermes_form():
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "cold", "tool_call_id": "call_1"}]
    out, extra = template_messages(msgs, [WEATHER], "{{ messages }}")
    assert extra == {} and out[0]["role"] == "system" and '"name": "weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert "tool_calls" not in out[2] and "tool_call_id" not in out[3]
    out, extra = template_messages(msgs, [WEATHER], "{% for t in tools %}{% endfor %}")
    assert extra == {"tools": [WEATHER]} and out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


ANSWERS = [  # (mode, answer) as models write them
    ("forced", '{"name": "weather", "arguments": {"city": "Paris \\"centre\\" {1}"}}'),
    ("forced", '{ "arguments" : {"city": "Oslo"}, "name" : "weather" }'),          # arguments before the name
    ("auto", 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
             '<tool_call>{"name": "unknown", "arguments": {}}</tool_call><tool_call>{"name": "time"}</tool_call> ok'),
    ("auto", 'Sure.[TOOL_CALLS][{"name": "time", "arguments": {}}, {"name": "weather", "arguments": {"city": "R"}}]'),
    ("auto", '<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}'),
    ("auto", '[{"name": "time", "arguments": {}}]'),
    ("auto", '[a link](x) <tool_call>{"name": "time", "arguments": {"n": [1, {"a": "}"}], "f": 2.5e3}}</tool_call>'),
    ("auto", 'No call: <tool_ca and [TOOL_C are only text.'),
    ("auto", '<tool_call>{"name": "weather", "arguments": {"city": "Lima"}'),          # cut short in the block
    ("auto", '<tool_call>not json</tool_call> after'),
]


def _streamed(mode: str, answer: str, cuts: list[int]) -> tuple[dict, list[dict]]:
    """The deltas of `answer` fed in pieces cut at `cuts`, merged, and each one alone."""
    reader, merged, deltas = CallReader(mode, [WEATHER, TIME]), {}, []
    bounds = [0, *sorted(set(cuts)), len(answer)]
    for a, b in zip(bounds, bounds[1:]):
        deltas.append(reader.feed(answer[a:b]))
    deltas.append(reader.finish())
    for d in deltas:
        merged = merge_deltas(merged, d)
    return merged, deltas


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(ANSWERS), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_a_streamed_answer_is_the_same_answer_however_it_is_cut(case, cuts):
    """Streamed, an answer's content and calls (names, arguments) are those of the whole answer read at once, for
    any way of cutting it into pieces; each call is announced (id, type, name) once, before its arguments."""
    mode, answer = case
    whole_content, whole_calls = parse(answer, mode, [WEATHER, TIME])
    merged, deltas = _streamed(mode, answer, [c % (len(answer) + 1) for c in cuts])
    assert (merged.get("content", "").strip() or None) == whole_content
    assert [c["function"] for c in merged.get("tool_calls", [])] == [c["function"] for c in whole_calls]
    announced = [c for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert [c["index"] for c in announced] == list(range(len(whole_calls)))
    assert all(c["type"] == "function" and c["function"]["name"] for c in announced)


def test_a_call_is_announced_as_soon_as_its_name_is_read_and_its_arguments_follow_as_written():
    answer = 'Checking. <tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    reader = CallReader("auto", [WEATHER, TIME])
    assert reader.feed("Checking. <tool_") == {"content": "Checking. "}               # may be a marker: held
    first = reader.feed('call>{"name": "weather", "arguments": {"ci')
    assert first["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"ci'}
    assert first["tool_calls"][0]["id"].startswith("call_")
    assert reader.feed('ty": "Par') == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Par'}}]}
    rest = merge_deltas(reader.feed(answer[len('Checking. <tool_call>{"name": "weather", "arguments": {"city": "Par'):]),
                        reader.finish())
    assert rest == {"tool_calls": [{"index": 0, "function": {"arguments": 'is"}'}}]}
    assert reader.calls[0]["function"]["arguments"] == '{"city": "Paris"}' and reader.content == "Checking. "
    held = CallReader("auto", [WEATHER])                  # an answer that begins as JSON waits for its end
    assert held.feed('{"name": "weather", "parameters": {') == {}
    assert held.feed('"city": "Oslo"}}') == {}
    assert json.loads(held.finish()["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
