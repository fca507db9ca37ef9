"""Tool calls (runtime/tools.py): which mode a request asks for, how a finished answer's calls are read, and
how tools reach a template that does not know them."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from kilnx.runtime.openai_api import APIError  # noqa: E402
from kilnx.runtime.tools import call_schema, mode_of, parse, template_messages  # noqa: E402

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
    text = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call><tool_call>{"name": "time"}</tool_call>')
    content, calls = parse(text, "auto", [WEATHER, TIME])
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["weather", "time"]
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
