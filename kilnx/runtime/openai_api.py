"""OpenAI's API shapes for `kilnx serve`: the request bodies (pydantic), errors, and how choices, stream chunks
and log-probabilities are written for /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import json
from typing import Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kilnx.runtime.request import Finished, TokenLogprob

UNSUPPORTED = {   # field -> its value that means "not asked for"
    "suffix": None, "functions": None,
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body())


# ----------------------------------------------------------------------------- requests
class Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=64)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    logit_bias: dict[str, float] | None = None      # token id (as a string, OpenAI's JSON) -> added to its logit
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None          # vLLM's: more tokens that end the answer
    response_format: dict | None = None
    guided_json: Union[dict, str, None] = None      # vLLM's structured-output extensions
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    def grammar(self) -> str | None:
        """The llguidance grammar the output must follow (runtime/structured.py): OpenAI's response_format
        json_object / json_schema, or vLLM's guided_json / guided_regex / guided_choice; None for free text."""
        from kilnx.runtime import structured as S
        fmt = self.response_format or {"type": "text"}
        kind = fmt.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise APIError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema.",
                           param="response_format")
        asked = [name for name, on in (("response_format", kind != "text"), ("guided_json", self.guided_json is not None),
                                       ("guided_regex", self.guided_regex is not None),
                                       ("guided_choice", self.guided_choice is not None)) if on]
        if len(asked) > 1:
            raise APIError(400, f"give one of {', '.join(asked)}, not several.", param=asked[1])
        if not asked:
            return None
        try:
            if kind == "json_object":
                return S.json_object_grammar()
            if kind == "json_schema":
                schema = (fmt.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise S.GrammarError("response_format json_schema needs json_schema.schema, a JSON schema object.")
                return S.json_schema_grammar(schema)
            if self.guided_json is not None:
                return S.json_schema_grammar(self.guided_json)
            if self.guided_regex is not None:
                return S.regex_grammar(self.guided_regex)
            return S.choice_grammar(self.guided_choice)
        except S.GrammarError as e:
            raise APIError(400, str(e), param=asked[0]) from e

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs; a key that is not a token id or a bias outside [-100, 100] is
        a 400 naming the field."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise APIError(400, f"logit_bias keys are token ids, got {key!r}.", param="logit_bias")
            if not -100 <= bias <= 100:
                raise APIError(400, f"logit_bias values lie in [-100, 100], got {bias} for token {key}.",
                               param="logit_bias")
            pairs.append((int(key), float(bias)))
        return tuple(pairs)

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            value = extra.get(name, neutral)
            if value not in (neutral, None):
                raise APIError(400, f"`{name}`={value!r} is not supported by this server; leave it out.", param=name)

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=64)

    def candidates(self) -> int:
        """Samples drawn a prompt: best_of (the n with the highest mean token log-probability are returned)."""
        best_of = self.best_of or self.n
        if best_of < self.n:
            raise APIError(400, f"best_of ({best_of}) must be at least n ({self.n}).", param="best_of")
        if best_of > self.n and (self.stream or self.echo):
            raise APIError(400, "best_of above n cannot be streamed or echoed (the best are known at the end).",
                           param="best_of")
        return best_of

    def top(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict], None] = None


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None

    def tool_mode(self) -> tuple[str, list[dict]]:
        """("none" | "auto" | "forced", the tools the answer may call): runtime/tools.py."""
        from kilnx.runtime.tools import mode_of
        return mode_of(self.tools, self.tool_choice)

    def grammar(self) -> str | None:
        """A forced tool call's grammar (a call of one of the tools), else the response format's."""
        mode, tools = self.tool_mode()
        if mode != "forced":
            return super().grammar()
        if super().grammar() is not None:
            raise APIError(400, "give `tool_choice` or a response format, not both.", param="tool_choice")
        from kilnx.runtime import structured as S
        from kilnx.runtime.tools import call_schema
        try:
            return S.json_schema_grammar(call_schema(tools))
        except S.GrammarError as e:
            raise APIError(400, f"the tools' parameters: {e}", param="tools") from e

    def top(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "`top_logprobs` needs `logprobs`: true.", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def text_content(content) -> str:
    """A message's text: a string, or the text parts of a list of content parts (images are refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(400, f"message content of type {part.get('type')!r} is not supported; send text.",
                           param="messages")
        texts.append(part.get("text", ""))
    return "".join(texts)


# ----------------------------------------------------------------------------- responses
def usage(finished: list[Finished]) -> dict:
    p = sum(f.prompt_tokens for f in finished)
    c = sum(f.completion_tokens for f in finished)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in finished)}}


def finish_reason(f: Finished) -> str:
    return "length" if f.reason == "length" else "stop"


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Choice:
    """One choice as its events arrive: text pieces, log-probability entries, the end. `take()` hands over
    what came since the last take (a stream chunk's share)."""

    def __init__(self, index: int, prefix: str = ""):
        self.index = index
        self.text: list[str] = [prefix] if prefix else []
        self.logprobs: list[TokenLogprob] = []
        self.finished: Finished | None = None
        self._sent_text = self._sent_lp = 0

    def add(self, kind: str, payload) -> None:
        if kind == "text":
            self.text.append(payload)
        elif kind == "logprobs":
            self.logprobs.extend(payload)
        elif kind == "done":
            self.finished = payload

    def take(self) -> tuple[str, list[TokenLogprob]]:
        text, lps = "".join(self.text[self._sent_text:]), self.logprobs[self._sent_lp:]
        self._sent_text, self._sent_lp = len(self.text), len(self.logprobs)
        return text, lps


class Writer:
    """The response shapes of one endpoint: `chat` or completions, with log-probabilities when asked
    (`top` alternatives a token; None: not asked)."""

    def __init__(self, *, chat: bool, rid: str, created: int, model: str, top: int | None, token_text,
                 tools: tuple[str, list[dict]] = ("none", [])):
        self.chat, self.rid, self.created, self.model, self.top = chat, rid, created, model, top
        self.tool_mode, self.tools = tools      # with tools, calls are read from the answer (runtime/tools.py)
        self._readers: dict = {}                # choice index -> its CallReader, streaming with tools
        self.token_text = token_text            # id -> its text
        self._offset: dict[int, int] = {}       # completions' text_offset, running a choice

    def logprobs(self, index: int, lps: list[TokenLogprob]):
        if self.top is None:
            return None
        if self.chat:
            return {"content": [dict(self._chat_entry(lp.token, lp.logprob),
                                     top_logprobs=[self._chat_entry(t, v) for t, v in lp.top]) for lp in lps]}
        tokens = [self.token_text(lp.token) for lp in lps]
        offsets, at = [], self._offset.get(index, 0)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        self._offset[index] = at
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [None if lp.logprob is None else {self.token_text(t): v for t, v in lp.top}
                                 for lp in lps],
                "text_offset": offsets}

    def _chat_entry(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def response(self, choices: list[Choice], counted: list[Choice] | None = None) -> dict:
        """The whole response; `counted`: the choices whose tokens the usage counts (best_of: every sample)."""
        out = []
        for c in choices:
            text, lps = c.take()
            reason = finish_reason(c.finished)
            if self.chat:
                content, calls = self._calls(text)
                body = {"message": {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}}
                reason = "tool_calls" if calls and reason == "stop" else reason
            else:
                body = {"text": text}
            out.append({"index": c.index, **body, "logprobs": self.logprobs(c.index, lps), "finish_reason": reason})
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out,
                "usage": usage([c.finished for c in counted or choices])}

    def _calls(self, text: str) -> tuple[str | None, list[dict]]:
        if self.tool_mode == "none":
            return text, []
        from kilnx.runtime.tools import parse
        return parse(text, self.tool_mode, self.tools)

    def chunk(self, choice: Choice, *, role: bool = False) -> dict | None:
        """What `choice` has to send now: its new text and log-probabilities, and its end once it ended (None:
        nothing yet — with tools, text that may begin a call waits until it is known; runtime/tools.py)."""
        text, lps = choice.take()
        reason = finish_reason(choice.finished) if choice.finished is not None else None
        if self.chat and self.tool_mode != "none":
            from kilnx.runtime.tools import CallReader, merge_deltas
            reader = self._readers.setdefault(choice.index, CallReader(self.tool_mode, self.tools))
            delta = reader.feed(text)
            if choice.finished is not None:
                delta = merge_deltas(delta, reader.finish())
                reason = "tool_calls" if reader.calls and reason == "stop" else reason
            if role:
                delta = {"role": "assistant", "content": delta.pop("content", ""), **delta}
            elif not delta and reason is None and not lps:
                return None
            body = {"delta": delta}
        elif self.chat:
            body = {"delta": {"role": "assistant", "content": text} if role else ({"content": text} if text else {})}
        else:
            body = {"text": text}
        return self._chunk([{"index": choice.index, **body, "logprobs": self.logprobs(choice.index, lps) if lps else None,
                             "finish_reason": reason}])

    def usage_chunk(self, choices: list[Choice]) -> dict:
        return {**self._chunk([]), "usage": usage([c.finished for c in choices])}

    def _chunk(self, choices: list) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
