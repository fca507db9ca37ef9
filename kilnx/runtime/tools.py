"""Tool calls for `kilnx serve`'s chat API (OpenAI's `tools` / `tool_choice`).

- `tool_choice` "required" or a named function: the output is constrained (runtime/structured.py) to a JSON
  object {"name": <a tool's name>, "arguments": <that tool's parameters schema>}, which becomes the message's
  `tool_calls`. Any model can be made to call a tool this way.
- "auto" (the default when tools are given): the model writes freely; calls in the forms models are trained to
  write become `tool_calls` and the rest stays content: Hermes' `<tool_call>{"name", "arguments"}</tool_call>`
  (Qwen 2.5 / 3, Hermes), Mistral's `[TOOL_CALLS][{...}]`, and an answer that is a call or a list of calls as
  JSON (Llama 3.1's `{"name", "parameters"}`, after `<|python_tag|>` or not). Only names among the tools count.
- "none": the tools are shown to the template but the answer is text.

Streamed, an answer is read as it comes (CallReader): text as content, a call announced (id, name) once its
name is read, then its arguments as the model writes them — OpenAI's streamed `tool_calls` deltas.

The tools reach the model through the chat template's `tools` variable; a template that does not use it (SmolLM2's)
gets them described in a system message instead, and assistant turns' earlier calls written in the Hermes form.
"""

from __future__ import annotations

import json
import secrets

from kilnx.runtime.openai_api import APIError

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


def parse(text: str, mode: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished answer: CallReader's, read whole."""
    if mode not in ("forced", "auto"):
        return text, []
    reader = CallReader(mode, tools)
    reader.feed(text)
    reader.finish()
    return reader.content.strip() or None, reader.calls


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


# ----------------------------------------------------------------------------- reading calls as they come
_MARKERS = ("<tool_call>", "[TOOL_CALLS]")
_PYTHON_TAG = "<|python_tag|>"
_WS = " \t\r\n"


class _CallObject:
    """One call object, {"name": ..., "arguments" | "parameters": ...}, read a character at a time: its name once
    the name's string closed, the raw text of its arguments as it grows (keys in either order, others skipped)."""

    def __init__(self):
        self.state, self.key, self.raw_name = "start", "", ""
        self.name: str | None = None
        self.args, self.args_seen = "", False
        self.done = self.broken = False
        self._kind, self._depth, self._in_str, self._esc, self._capture = "", 0, False, False, False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the object (all, or up to its closing brace / a bad one)."""
        for i, ch in enumerate(text):
            self._step(ch)
            if self.broken:
                return i
            if self.done:
                return i + 1
        return len(text)

    def _step(self, ch: str) -> None:
        st = self.state
        if st in ("start", "key?", "colon", "value") and ch in _WS:
            return
        if st == "start":
            self.state, self.broken = "key?", ch != "{"
        elif st == "key?":
            if ch == "}":
                self.done = True
            elif ch == '"':
                self.state, self.key = "key", ""
            else:
                self.broken = ch != ","
        elif st in ("key", "name"):
            if self._esc or ch not in '\\"':
                self._esc = False
            elif ch == "\\":
                self._esc = True
            else:                                              # the string's closing quote
                if st == "name":
                    self.name = _json_string(self.raw_name)
                self.state = "colon" if st == "key" else "key?"
                return
            if st == "key":
                self.key += ch
            else:
                self.raw_name += ch
        elif st == "colon":
            self.state, self.broken = "value", ch != ":"
        elif st == "value":
            key = _json_string(self.key)
            if key == "name" and ch == '"':
                self.state, self.raw_name = "name", ""
                return
            self._capture = key in ("arguments", "parameters") and not self.args_seen
            self.args_seen |= self._capture
            self._kind = "container" if ch in "{[" else "string" if ch == '"' else "scalar"
            self._depth, self._in_str, self._esc = 1 if ch in "{[" else 0, ch == '"', False
            if self._kind == "scalar" and ch in ",}":
                self.broken = True
                return
            self.state = "raw"
            self._keep(ch)
        elif st == "raw":
            self._raw(ch)

    def _raw(self, ch: str) -> None:
        """A value's characters: arguments' kept, others' skipped; the value ends where its JSON does."""
        if self._kind == "scalar" and ch in _WS + ",}":
            self.state = "key?"
            self._step(ch)
            return
        self._keep(ch)
        if self._in_str:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                if self._kind == "string":
                    self.state = "key?"
        elif ch == '"':
            self._in_str = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self.state = "key?"

    def _keep(self, ch: str) -> None:
        if self._capture:
            self.args += ch


def _json_string(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return raw


class CallReader:
    """An answer read as it grows, into OpenAI's streamed deltas: `feed(piece)` and `finish()` each return
    {"content": ..., "tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}} or
    {"index", "function": {"arguments": <more>}}]} (keys only where there is something). A call is announced once
    its name is read and is a tool's; its arguments follow as the model writes them. Text that may begin a call
    marker is held until it is known not to; an answer that begins as JSON (Llama 3.1's calls) is held to its end.
    An object that is not a call of one of the tools is given back as content (its text). `content` and `calls`
    hold the answer so far; a finished answer's are the same however it was cut into pieces."""

    def __init__(self, mode: str, tools: list[dict], *, started: bool = False):
        self.mode, self.tools = mode, tools
        self.names = {t["function"]["name"] for t in tools}
        self.content, self.calls = "", []
        # text | held | call (a call object) | mistral (before its list) | list (between its objects) |
        # close (after a Hermes block's object)
        self.state = "call" if mode == "forced" else "text"
        self._buf, self._block, self._started = "", "", started
        self._obj: _CallObject | None = _CallObject() if mode == "forced" else None
        self._index: int | None = None            # the current object's place in calls, once announced
        self._sent_args, self._close_as_content = 0, False
        self._delta: dict = {}

    def feed(self, piece: str) -> dict:
        self._buf += piece
        while self._advance():
            pass
        return self._take()

    def finish(self) -> dict:
        rest, self._buf = self._buf, ""
        if self.state == "held":
            self._finish_held(rest)
        elif self.state == "call":                       # cut short: before its name it is text
            self._say((self._block if self._index is None else "") + rest)
        elif self.state == "text" or (self.state == "close" and self._close_as_content):
            self._say(rest)
        elif self.state == "mistral":
            self._say("[TOOL_CALLS]" + rest)
        self.state, self._obj = "text", None
        return self._take()

    def _advance(self) -> bool:
        if self.state == "text":
            return self._text()
        if self.state == "call":
            return self._read_object()
        buf = self._buf
        stripped = buf.lstrip(_WS)
        if self.state in ("mistral", "list") and not stripped:
            return False
        if self.state == "mistral":
            if stripped[0] == "[":
                self._buf, self.state = stripped[1:], "list"
            else:
                self._say("[TOOL_CALLS]")
                self.state = "text"
            return True
        if self.state == "list":
            if stripped[0] == ",":
                self._buf = stripped[1:]
            elif stripped[0] == "]":
                self._buf, self.state = stripped[1:], "text"
            else:
                self._buf, self.state, self._block, self._obj = stripped, "call", "", _CallObject()
            return True
        if self.state == "close":
            tag = "</tool_call>"
            if len(stripped) < len(tag) and tag.startswith(stripped):
                return False                             # may yet be the closing tag
            if stripped.startswith(tag):
                if self._close_as_content:
                    self._say(buf[:len(buf) - len(stripped)] + tag)
                self._buf = stripped[len(tag):]
            self.state = "text"
            return True
        return False                                     # held: all of it waits for the end

    def _text(self) -> bool:
        buf = self._buf
        if not self._started and self.mode == "auto":
            stripped = buf.lstrip(_WS)
            if any(m.startswith(stripped) and m != stripped for m in _MARKERS + (_PYTHON_TAG,)):
                return False                             # may yet be a marker
            if not stripped.startswith(_MARKERS) and stripped.startswith(("{", "[", _PYTHON_TAG)):
                self.state = "held"
                return False
            self._started = True
        found = [(buf.find(m), m) for m in _MARKERS if m in buf]
        if found:
            i, marker = min(found)
            self._say(buf[:i])
            self._buf = buf[i + len(marker):]
            if marker == "[TOOL_CALLS]":
                self.state = "mistral"
            else:
                self.state, self._block, self._obj = "call", marker, _CallObject()
            return True
        keep = max((k for m in _MARKERS for k in range(1, len(m)) if buf.endswith(m[:k])), default=0)
        self._say(buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _read_object(self) -> bool:
        obj = self._obj
        n = obj.feed(self._buf)
        self._block += self._buf[:n]
        self._buf = self._buf[n:]
        if self._index is None and obj.name in self.names:
            self._announce(obj.name)
        if self._index is not None:
            more = "{}" if obj.done and not obj.args_seen else obj.args[self._sent_args:]
            self._sent_args += len(more)
            self._arguments(more)
        if not (obj.done or obj.broken):
            return False
        hermes = self._block.startswith("<tool_call>")
        if self._index is None:                          # not a call of one of the tools: its text is content
            self._say(self._block)
        self._close_as_content = self._index is None
        self._obj, self._index, self._sent_args = None, None, 0
        self.state = "text" if obj.broken or self.mode == "forced" else "close" if hermes else "list"
        return True

    def _announce(self, name: str) -> None:
        self._index = len(self.calls)
        call = {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        self._delta.setdefault("tool_calls", {})[self._index] = {"index": self._index, **call,
                                                                 "function": dict(call["function"])}

    def _arguments(self, more: str) -> None:
        if not more:
            return
        self.calls[self._index]["function"]["arguments"] += more
        entry = self._delta.setdefault("tool_calls", {}).setdefault(
            self._index, {"index": self._index, "function": {"arguments": ""}})
        entry["function"]["arguments"] += more

    def _finish_held(self, text: str) -> None:
        """An answer that began as JSON: a call or a list of calls as a whole (Llama 3.1's `{"name", "parameters"}`,
        after <|python_tag|> or not), else read again as text."""
        try:
            objs = json.loads(text.replace(_PYTHON_TAG, "").strip())
        except json.JSONDecodeError:
            objs = None
        objs = objs if isinstance(objs, list) else [objs]
        if objs and all(isinstance(o, dict) and o.get("name") in self.names for o in objs):
            for o in objs:
                self._announce(o["name"])
                self._arguments(json.dumps(o.get("arguments", o.get("parameters", {}))))
            self._index = None
            return
        again = CallReader(self.mode, self.tools, started=True)
        delta = merge_deltas(again.feed(text), again.finish())
        self.content, self.calls = again.content, again.calls
        self._delta = dict(delta)
        if "tool_calls" in delta:
            self._delta["tool_calls"] = {c["index"]: c for c in delta["tool_calls"]}

    def _say(self, text: str) -> None:
        if text:
            self.content += text
            self._delta["content"] = self._delta.get("content", "") + text

    def _take(self) -> dict:
        delta, self._delta = self._delta, {}
        if "tool_calls" in delta:
            delta["tool_calls"] = [delta["tool_calls"][k] for k in sorted(delta["tool_calls"])]
        return delta


def merge_deltas(a: dict, b: dict) -> dict:
    """Two successive deltas as one."""
    out = {**a, **({"content": a.get("content", "") + b["content"]} if "content" in b else {})}
    calls = {c["index"]: {**c, "function": dict(c["function"])} for c in a.get("tool_calls", [])}
    for c in b.get("tool_calls", []):
        if c["index"] in calls:
            calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
        else:
            calls[c["index"]] = {**c, "function": dict(c["function"])}
    if calls:
        out["tool_calls"] = [calls[k] for k in sorted(calls)]
    return out
