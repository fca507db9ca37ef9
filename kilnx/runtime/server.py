"""An OpenAI-compatible HTTP server over the continuous-batching scheduler (`kilnx serve`).

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, with `stream` (server-
sent events, `data: [DONE]` at the end, `stream_options.include_usage`), `max_tokens` (chat also takes
`max_completion_tokens`), `temperature`, `top_p`, `top_k` and `ignore_eos` (vLLM's extensions), `seed`, `stop`
and several prompts in one completions request (one choice each, decoded side by side). What this server cannot
honour (n > 1, logprobs, penalties, logit_bias, echo, tools, a JSON response format) is refused with a 400 that
names the field, never silently ignored. Errors take OpenAI's shape: {"error": {"message", "type", "param",
"code"}}.

Defaults follow OpenAI: temperature 1, completions max_tokens 16, chat max_tokens up to the context's end; an
explicit max_tokens that does not fit beside the prompt is refused (code `context_length_exceeded`), as are
prompts that do not fit at all.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from kilnx.models.errors import ContextLengthError, ModelError
from kilnx.runtime.sampling import SamplingParams
from kilnx.runtime.scheduler import Finished, Scheduler, check_prompt

UNSUPPORTED = {   # field -> its value that means "not asked for"
    "n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "presence_penalty": 0,
    "frequency_penalty": 0, "logit_bias": None, "suffix": None, "tools": None, "functions": None,
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code}})


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            value = extra.get(name, neutral)
            if value not in (neutral, None) and not (name == "logit_bias" and value == {}):
                raise APIError(400, f"`{name}`={value!r} is not supported by this server; leave it out.", param=name)
        fmt = extra.get("response_format")
        if fmt not in (None, {"type": "text"}):
            raise APIError(400, "only text responses are supported; leave `response_format` out.",
                           param="response_format")

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict], None] = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)


def _text_content(content) -> str:
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


class Server:
    """The state behind the routes: the loaded model, its scheduler and the name it is served under."""

    def __init__(self, lm, scheduler: Scheduler, name: str):
        self.lm, self.scheduler, self.name = lm, scheduler, name
        self.created = int(time.time())

    # ------------------------------------------------------------------ request -> work
    def check_model(self, req: _Sampling) -> None:
        if req.model not in (None, self.name):
            raise APIError(404, f"the model `{req.model}` does not exist here; this server serves `{self.name}`.",
                           param="model", code="model_not_found")

    def prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            p = [p]
        if p and all(isinstance(t, int) for t in p):
            p = [p]
        if not p:
            raise APIError(400, "`prompt` is empty.", param="prompt")
        out = []
        for one in p:
            if isinstance(one, str):
                out.append(self._tokenizer().encode(one))
            else:
                vocab = self.lm.config.vocab_size
                if not all(0 <= t < vocab for t in one):
                    raise APIError(400, f"token ids must lie in [0, {vocab}).", param="prompt")
                out.append(list(one))
        return out

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        messages = [{"role": m.role, "content": _text_content(m.content)} for m in req.messages]
        tok = self._tokenizer()
        try:
            text = tok.apply_chat_template(messages)
        except ModelError as e:
            raise APIError(400, f"{e} Use /v1/completions for this model.", param="messages") from e
        except Exception as e:     # the template's own raise_exception (e.g. roles out of order)
            raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from e
        return tok.encode(text, add_special_tokens=False)

    def _tokenizer(self):
        if self.lm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids as the prompt of /v1/completions.")
        return self.lm.tokenizer

    def params(self, req: _Sampling, n_prompt: int, max_tokens: int | None, default_max: int | None) -> SamplingParams:
        engine = self.scheduler.engine
        try:
            check_prompt(engine, n_prompt, max_tokens)
        except ContextLengthError as e:
            raise APIError(400, f"{e} (This server's context is its --max-seq.)", param="messages"
                           if isinstance(req, ChatRequest) else "prompt", code="context_length_exceeded") from e
        room = engine.max_seq - n_prompt
        budget = max_tokens if max_tokens is not None else min(default_max or room, room)
        seed = req.seed if req.seed is not None else secrets.randbits(31)
        return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=seed,
                              max_tokens=budget, ignore_eos=req.ignore_eos)

    # ------------------------------------------------------------------ running
    async def run(self, work: list[tuple[list[int], SamplingParams]], stops: tuple[str, ...]):
        """Submit every prompt; yield (index, kind, payload) events as the scheduler produces them, until each
        is done. Leaving early (a client gone) cancels what is still running."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def listener(i):
            return lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (i, kind, payload))
        reqs = [self.scheduler.submit(ids, sp, listener(i), stops) for i, (ids, sp) in enumerate(work)]
        pending = len(reqs)
        try:
            while pending:
                i, kind, payload = await events.get()
                if kind == "error":
                    raise APIError(500, f"generation failed: {payload}", kind="server_error")
                pending -= kind == "done"
                yield i, kind, payload
        finally:
            for r in reqs:
                r.cancel()


def _usage(finished: list[Finished]) -> dict:
    p = sum(f.prompt_tokens for f in finished)
    c = sum(f.completion_tokens for f in finished)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in finished)}}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="kilnx", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())[1:])
        return APIError(400, f"{where or 'body'}: {first.get('msg')}", param=where or None).response()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "kilnx", "max_model_len": server.scheduler.engine.max_seq}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        server.check_model(req)
        req.refuse_unsupported()
        prompts = server.prompts(req)
        work = [(ids, server.params(req, len(ids), req.max_tokens, 16)) for ids in prompts]
        rid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())

        def chunk(i, text, reason):
            return {"id": rid, "object": "text_completion", "created": created, "model": server.name,
                    "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}]}
        if req.stream:
            return _stream(server, work, req, chunk, lambda u: {**chunk(0, "", None), "choices": [], "usage": u})
        texts, done = [[] for _ in work], [None] * len(work)
        async for i, kind, payload in server.run(work, req.stops()):
            (texts[i].append(payload) if kind == "text" else done.__setitem__(i, payload))
        return {"id": rid, "object": "text_completion", "created": created, "model": server.name,
                "choices": [{"index": i, "text": "".join(t), "logprobs": None, "finish_reason": _reason(f)}
                            for i, (t, f) in enumerate(zip(texts, done))],
                "usage": _usage(done)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        server.check_model(req)
        req.refuse_unsupported()
        ids = server.chat_prompt(req)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        work = [(ids, server.params(req, len(ids), limit, None))]
        rid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

        def chunk(i, text, reason):
            delta = {"content": text} if text else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": server.name,
                    "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        if req.stream:
            first = {**chunk(0, "", None)}
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            return _stream(server, work, req, chunk, lambda u: {**chunk(0, "", None), "choices": [], "usage": u},
                           first=first)
        texts, done = [], None
        async for _, kind, payload in server.run(work, req.stops()):
            if kind == "text":
                texts.append(payload)
            else:
                done = payload
        return {"id": rid, "object": "chat.completion", "created": created, "model": server.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(texts)},
                             "logprobs": None, "finish_reason": _reason(done)}],
                "usage": _usage([done])}

    return app


def _reason(f: Finished) -> str:
    return "length" if f.reason == "length" else "stop"


def _stream(server: Server, work, req: _Sampling, chunk, usage_chunk, first: dict | None = None) -> StreamingResponse:
    async def events():
        done: list[Finished] = []
        if first is not None:
            yield _sse(first)
        try:
            async for i, kind, payload in server.run(work, req.stops()):
                if kind == "text":
                    yield _sse(chunk(i, payload, None))
                else:
                    done.append(payload)
                    yield _sse(chunk(i, "", _reason(payload)))
        except APIError as e:          # the headers are sent: the error goes in the stream
            yield _sse({"error": {"message": e.message, "type": e.kind, "param": None, "code": None}})
            return
        if req.include_usage():
            yield _sse(usage_chunk(_usage(done)))
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def serve_forever(server: Server, host: str, port: int) -> None:
    import uvicorn
    uvicorn.run(create_app(server), host=host, port=port, log_level="info")

