"""An OpenAI-compatible HTTP server over the continuous-batching scheduler (`kilnx serve`).

Endpoints: GET /health, GET /metrics (Prometheus), GET /v1/models, POST /v1/completions, POST /v1/chat/completions, with `stream` (server-
sent events, `data: [DONE]` at the end, `stream_options.include_usage`), `max_tokens` (chat also takes
`max_completion_tokens`), `temperature`, `top_p`, `presence_penalty`, `frequency_penalty`, `top_k`, `min_p`,
`repetition_penalty`, `min_tokens` and `ignore_eos` (vLLM's extensions), `logit_bias`, `seed`, `stop`,
log-probabilities (completions: `logprobs` N and `echo`, which also scores the prompt — with `max_tokens` 0, a
loglikelihood request as evaluation harnesses send; chat: `logprobs` and `top_logprobs`) and several prompts in
one completions request and `n` choices a prompt (choice j sampled with seed + j; all decoded side by side).
Structured output: `response_format` json_object / json_schema (OpenAI's), `guided_json`, `guided_regex`,
`guided_choice` (vLLM's), through llguidance (runtime/structured.py); tool calls (`tools`, `tool_choice`,
runtime/tools.py).
`best_of` (completions) returns the n samples of best_of with the highest mean token log-probability.
What this server cannot honour (the legacy functions, suffix) is refused with a 400 that names the field, never silently
ignored. Errors take OpenAI's shape: {"error": {"message", "type", "param", "code"}}. Log-probabilities are the
model's (log-softmax of its logits, before temperature and filters).

Defaults follow OpenAI: temperature 1, completions max_tokens 16, chat max_tokens up to the context's end; an
explicit max_tokens that does not fit beside the prompt is refused (code `context_length_exceeded`), as are
prompts that do not fit at all.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from kilnx.models.errors import ContextLengthError, ModelError
from kilnx.runtime.openai_api import (APIError, ChatRequest, Choice, CompletionRequest, Sampling, Writer, sse,
                                      text_content)
from kilnx.runtime.sampling import SamplingParams
from kilnx.runtime.scheduler import Scheduler, check_prompt


class Server:
    """The state behind the routes: the loaded model, its scheduler and the name it is served under."""

    def __init__(self, lm, scheduler: Scheduler, name: str, *, api_key: str | None = None):
        self.lm, self.scheduler, self.name, self.api_key = lm, scheduler, name, api_key
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}
        from kilnx.runtime.serve_metrics import Metrics
        self.metrics = Metrics(scheduler)

    # ------------------------------------------------------------------ request -> work
    def check_model(self, req: Sampling) -> None:
        if req.model not in (None, self.name):
            raise APIError(404, f"the model `{req.model}` does not exist here; this server serves `{self.name}`.",
                           param="model", code="model_not_found")

    def prompts(self, req: CompletionRequest) -> list[tuple[list[int], str]]:
        """Each prompt's (token ids, text)."""
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
                out.append((self._tokenizer().encode(one), one))
                continue
            vocab = self.lm.config.vocab_size
            if not all(0 <= t < vocab for t in one):
                raise APIError(400, f"token ids must lie in [0, {vocab}).", param="prompt")
            text = self.lm.tokenizer.decode(one) if (req.echo and self.lm.tokenizer is not None) else ""
            out.append((list(one), text))
        return out

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        from kilnx.runtime.tools import template_messages
        messages = [{**m.model_dump(exclude_none=True), "content": text_content(m.content)} for m in req.messages]
        tok = self._tokenizer()
        mode, tools = req.tool_mode()
        try:
            if tools and tok.chat_template:
                messages, extra = template_messages(messages, tools, tok.chat_template)
                text = tok.apply_chat_template(messages, **extra)
            else:
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

    def token_text(self, token: int) -> str:
        if token not in self._token_texts:
            tok = self.lm.tokenizer
            self._token_texts[token] = tok.decode([token], skip_special_tokens=False) if tok else str(token)
        return self._token_texts[token]

    def params(self, req: Sampling, n_prompt: int, max_tokens: int | None,
               default_max: int | None, count: int | None = None) -> list[SamplingParams]:
        """The sampling of each of the prompt's req.n (or `count`) samples: sample j draws with seed + j (a given
        seed makes the whole request reproducible; none, a random one)."""
        engine = self.scheduler.engine
        try:
            check_prompt(engine, n_prompt, max_tokens)
        except ContextLengthError as e:
            raise APIError(400, f"{e} (This server's context is its --max-seq.)", param="messages"
                           if isinstance(req, ChatRequest) else "prompt", code="context_length_exceeded") from e
        room = engine.max_seq - n_prompt
        budget = max_tokens if max_tokens is not None else min(default_max or room, room)
        seed = req.seed if req.seed is not None else secrets.randbits(31)
        bias, grammar = req.bias_pairs(), req.grammar()
        if any(not 0 <= t < engine.config.vocab_size for t in req.stop_token_ids or ()):
            raise APIError(400, f"stop_token_ids must lie in [0, {engine.config.vocab_size}).", param="stop_token_ids")
        past = [t for t, _ in bias if t >= engine.config.vocab_size]
        if past:
            raise APIError(400, f"logit_bias names token {past[0]}; this model has {engine.config.vocab_size}.",
                           param="logit_bias")
        return [SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                               seed=seed + j,
                               max_tokens=budget, ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty,
                               frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                               logit_bias=bias, min_tokens=req.min_tokens, grammar=grammar,
                               stop_token_ids=tuple(req.stop_token_ids or ()))
                for j in range(count or req.n)]

    # ------------------------------------------------------------------ running
    def run(self, work: list[tuple[list[int], SamplingParams]], stops: tuple[str, ...], *,
            logprobs: int | None = None, echo: bool = False):
        """Submit every prompt now — what the scheduler refuses (a grammar that does not compile, stop strings
        without a tokenizer) is a 400 here, before a stream's headers go out — and return the async iterator
        of (index, kind, payload) events."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def listener(i):
            return lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (i, kind, payload))
        t0 = time.perf_counter()
        reqs = []
        try:
            for i, (ids, sp) in enumerate(work):
                reqs.append(self.scheduler.submit(ids, sp, listener(i), stops, logprobs=logprobs, echo=echo))
        except ValueError as e:             # GrammarError is one
            for r in reqs:
                r.cancel()
            raise APIError(400, str(e)) from e
        return self._events(reqs, events, t0)

    async def _events(self, reqs, events: asyncio.Queue, t0: float):
        """Yield the requests' events until each is done. Leaving early (a client gone) cancels what is still
        running."""
        first: dict[int, float] = {}
        pending = len(reqs)
        try:
            while pending:
                i, kind, payload = await events.get()
                if kind == "error":
                    raise APIError(500, f"generation failed: {payload}", kind="server_error")
                now = time.perf_counter() - t0
                if kind == "text":     # the first token's text (later, where a stop string holds it back)
                    first.setdefault(i, now)
                if kind == "done":
                    pending -= 1
                    self.metrics.finished(payload, first.get(i, now if payload.token_ids else None), now)
                yield i, kind, payload
        finally:
            for r in reqs:
                r.cancel()

    async def best_of(self, req: CompletionRequest, writer: Writer, work, prompts: int, best_of: int):
        """best_of samples a prompt, each token's log-probability computed; the n with the highest mean are the
        prompt's choices (OpenAI's rule), in that order. Usage counts every sample's tokens."""
        samples = [Choice(k) for k in range(len(work))]
        async for i, kind, payload in self.run(work, req.stops(), logprobs=req.logprobs or 0):
            samples[i].add(kind, payload)

        def mean_logprob(c: Choice) -> float:
            lps = [lp.logprob for lp in c.logprobs if lp.logprob is not None]
            return sum(lps) / len(lps) if lps else float("-inf")
        chosen = []
        for p in range(prompts):
            group = sorted(samples[p * best_of:(p + 1) * best_of], key=mean_logprob, reverse=True)[:req.n]
            for j, c in enumerate(group):
                c.index = p * req.n + j
                if req.logprobs is None:
                    c.logprobs = []
                chosen.append(c)
        return writer.response(chosen, counted=samples)

    async def answer(self, req: Sampling, writer: Writer, work, choices: list[Choice], *, echo: bool = False):
        """The whole response, or with req.stream a StreamingResponse of its chunks."""
        events = self.run(work, req.stops(), logprobs=writer.top, echo=echo)
        if not req.stream:
            async for i, kind, payload in events:
                choices[i].add(kind, payload)
            return writer.response(choices)

        async def chunks():
            if writer.chat:
                for c in choices:
                    yield sse(writer.chunk(c, role=True))
            elif any(c.text for c in choices):               # echo: the prompts first
                for c in choices:
                    yield sse(writer.chunk(c))
            try:
                async for i, kind, payload in events:
                    choices[i].add(kind, payload)
                    if kind != "logprobs":                     # these ride with the next text or the end
                        chunk = writer.chunk(choices[i])
                        if chunk is not None:
                            yield sse(chunk)
            except APIError as e:          # the headers are sent: the error goes in the stream
                yield sse(e.body())
                return
            if req.include_usage():
                yield sse(writer.usage_chunk(choices))
            yield "data: [DONE]\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="kilnx", docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())[1:])
        return APIError(400, f"{where or 'body'}: {first.get('msg')}", param=where or None).response()

    @app.middleware("http")
    async def _authorize(request: Request, call_next):
        # with an API key every /v1 route wants `Authorization: Bearer <key>` (OpenAI clients send it); /health
        # stays open for load balancers
        if server.api_key and request.url.path.startswith("/v1") and \
                not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {server.api_key}"):
            return APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`.",
                            kind="authentication_error", code="invalid_api_key").response()
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "kilnx", "max_model_len": server.scheduler.engine.max_seq}]}

    @app.post("/tokenize")
    async def tokenize(body: dict):
        """vLLM's: a prompt's token ids ({"prompt"}, or {"messages"} through the chat template)."""
        if "messages" in body:
            try:
                chat = ChatRequest(**{k: v for k, v in body.items() if k in ("messages", "tools")})
            except ValidationError as e:
                raise APIError(400, f"messages: {e.errors()[0].get('msg')}", param="messages") from e
            ids = server.chat_prompt(chat)
        elif isinstance(body.get("prompt"), str):
            ids = server._tokenizer().encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        else:
            raise APIError(400, "send a `prompt` string or `messages`.", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": server.scheduler.engine.max_seq}

    @app.post("/detokenize")
    async def detokenize(body: dict):
        ids = body.get("tokens")
        vocab = server.lm.config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise APIError(400, f"`tokens` must be a list of token ids in [0, {vocab}).", param="tokens")
        return {"prompt": server._tokenizer().decode(ids, skip_special_tokens=False)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        server.check_model(req)
        req.refuse_unsupported()
        prompts = server.prompts(req)
        best_of = req.candidates()
        # choice i * n + j: prompt i's j-th sample (OpenAI's order)
        work = [(ids, sp) for ids, _ in prompts for sp in server.params(req, len(ids), req.max_tokens, 16, best_of)]
        writer = Writer(chat=False, rid=f"cmpl-{secrets.token_hex(12)}", created=int(time.time()), model=server.name,
                        top=req.top(), token_text=server.token_text)
        if best_of > req.n:
            return await server.best_of(req, writer, work, len(prompts), best_of)
        choices = [Choice(i * req.n + j, text if req.echo else "") for i, (_, text) in enumerate(prompts)
                   for j in range(req.n)]
        return await server.answer(req, writer, work, choices, echo=req.echo)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        server.check_model(req)
        req.refuse_unsupported()
        ids = server.chat_prompt(req)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        writer = Writer(chat=True, rid=f"chatcmpl-{secrets.token_hex(12)}", created=int(time.time()),
                        model=server.name, top=req.top(), token_text=server.token_text, tools=req.tool_mode())
        work = [(ids, sp) for sp in server.params(req, len(ids), limit, None)]
        return await server.answer(req, writer, work, [Choice(j) for j in range(req.n)])

    return app


def serve_forever(server: Server, host: str, port: int) -> None:
    import uvicorn
    uvicorn.run(create_app(server), host=host, port=port, log_level="info")
