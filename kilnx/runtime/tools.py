"""Tool calls for `kilnx serve`'s chat API (OpenAI's `tools` / `tool_choice`).

- `tool_choice` "required" or a named function: the output is constrained (runtime/structured.py) to a JSON
  object {"name": <a tool's name>, "arguments": <that tool's parameters schema>}, which becomes the message's
  `tool_calls`. Any model can be made to call a tool this way.
- "auto" (the default when tools are given): the model writes freely; calls in the forms models are trained to
  write become `tool_calls` and the rest stays content: Hermes' `<tool_call>{"name", "arguments"}</tool_call>`
  (Qwen 2.5 / 3, Hermes), Mistral's `[TOOL_CALLS][{...}]`, and an answer that is a call or a list of calls as
  JSON (Llama 3.1's `{"name", "parameters"}`, after `<|python_tag|>` or not). Only names among the tools count.
- "none": the tools are shown to the template but the answer is text.

The tools reach the model through the chat template's `tools` variable; a template that does not use it (SmolLM2's)
gets them described in a system message instead, and assistant turns' earlier calls written in the Hermes form.
"""

from __future__ import annotations

import json
import re
import secrets

from kilnx.runtime.openai_api import APIError

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def check_tools(tools) -> list[dict]:
    """The request's `tools`, each {"type": "function", "function": {"name", "parameters"?, "description"?}}."""
    if not isinstance(tools, list) or not tools:
        raise APIError(400, "`tools` must be a non-empty list of functions.", param="tools")
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, "each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                                "\"parameters\": {...}}}.", param="tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise APIError(400, f"tool {fn['name']!r}: `parameters` must be a JSON schema object.", param="tools")
    return tools


def mode_of(tools, tool_choice) -> tuple[str, list[dict]]:
    """("none" | "auto" | "forced", the tools the output may call)."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise APIError(400, "`tool_choice` needs `tools`.", param="tool_choice")
        return "none", []
    tools = check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto"):
        return choice, tools
    if choice == "required":
        return "forced", tools
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if name is None:
        raise APIError(400, "`tool_choice` is none, auto, required or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}.", param="tool_choice")
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise APIError(400, f"`tool_choice` names {name!r}, which is not among the tools.", param="tool_choice")
    return "forced", named


def call_schema(tools: list[dict]) -> dict:
    """The JSON schema of one call of one of `tools`."""
    options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  "arguments": t["function"].get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _call(obj: dict) -> dict:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))}}


def parse(text: str, mode: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished answer."""
    if mode == "forced":
        try:
            return None, [_call(json.loads(text))]
        except (json.JSONDecodeError, KeyError, TypeError):   # cut short by max_tokens: no complete call
            return text, []
    if mode != "auto":
        return text, []
    names = {t["function"]["name"] for t in tools}

    def calls_in(objs) -> list[dict]:
        objs = objs if isinstance(objs, list) else [objs]
        if not objs or not all(isinstance(o, dict) and o.get("name") in names for o in objs):
            return []
        return [_call({"name": o["name"], "arguments": o.get("arguments", o.get("parameters", {}))}) for o in objs]

    calls = []                                    # Hermes: <tool_call>{...}</tool_call> blocks amid the text
    for block in _CALL.findall(text):
        try:
            calls += calls_in(json.loads(block))
        except json.JSONDecodeError:
            continue
    if calls:
        return _CALL.sub("", text).strip() or None, calls
    # Mistral's [TOOL_CALLS][...], or the whole answer one call / a list of them as Llama 3.1 writes them
    # ({"name", "parameters"}, after <|python_tag|> or not)
    head, marker, tail = text.partition("[TOOL_CALLS]")
    body = tail if marker else text.replace("<|python_tag|>", "")
    try:
        calls = calls_in(json.loads(body.strip()))
    except json.JSONDecodeError:
        calls = []
    if not calls:
        return text, []
    return (head.strip() or None) if marker else None, calls


def template_messages(messages: list[dict], tools: list[dict], template: str) -> tuple[list[dict], dict]:
    """(messages, extra template variables) for rendering a conversation with tools through `template`."""
    if "tools" in template:
        return [_with_arguments_as_objects(m) for m in messages], ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        m.pop("tool_call_id", None)
        written = "".join(f"<tool_call>\n{json.dumps(_plain(c))}\n</tool_call>" for c in calls)
        m["content"] = (m.get("content") or "") + written
        out.append(m)
    if tools:
        described = ("You can call these functions. To call one, answer with <tool_call>{\"name\": ..., "
                     "\"arguments\": {...}}</tool_call>.\n" + "\n".join(json.dumps(t["function"]) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, {}


def _plain(call: dict) -> dict:
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    return {"name": fn.get("name"), "arguments": args}


def _with_arguments_as_objects(m: dict) -> dict:
    """Templates that render tool calls (Qwen's) expect `arguments` as an object; OpenAI sends a JSON string."""
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {**c.get("function", {}), "arguments": _plain(c)["arguments"]}} for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}
