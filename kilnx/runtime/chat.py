"""`kilnx chat`: a conversation in the terminal, each turn prefilling only what is new.

Each turn renders the whole conversation with the model's chat template and hands it to a one-row Scheduler:
the row keeps the K/V of everything it has seen, so a turn's prompt reuses it and prefills only the new user
message (and whatever of the last reply the template re-tokenizes differently). When the conversation outgrows
the context, the oldest turns are dropped (a system message stays) until the prompt and a reply fit.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Iterator, Optional

import typer
from typing_extensions import Annotated

from kilnx.runtime.cli import _KV_HELP
from kilnx.runtime.request import Finished
from kilnx.runtime.sampling import SamplingParams
from kilnx.runtime.scheduler import Scheduler


def print_stream(items, summary=None) -> None:
    """Write a scheduler stream's text to stdout as it comes; at its Finished, a newline and `summary(finished)`
    (if given) on stderr."""
    for item in items:
        if isinstance(item, Finished):
            sys.stdout.write("\n")
            if summary is not None:
                print(summary(item), file=sys.stderr)
        else:
            sys.stdout.write(item)
            sys.stdout.flush()


class Conversation:
    """Messages so far and the scheduler that answers them; `reply(text)` streams the assistant's answer."""

    def __init__(self, lm, scheduler: Scheduler, params: SamplingParams, system: str | None = None):
        if lm.tokenizer is None or not lm.tokenizer.chat_template:
            from kilnx.models.errors import ModelError
            raise ModelError(f"{lm.source}: no chat template, so no conversation to render; use kilnx generate.")
        self.lm, self.scheduler, self.params = lm, scheduler, params
        self.system = system
        self.messages: list[dict] = []
        self.dropped = 0                  # turns dropped to fit the context, over the conversation

    def reset(self) -> None:
        self.messages = []

    def _prompt(self) -> list[int]:
        """The conversation's token ids, its oldest turns dropped until a reply of max_tokens (or, without
        room for that, of a quarter of the context) fits."""
        tok, max_seq = self.lm.tokenizer, self.scheduler.engine.max_seq
        room = min(self.params.max_tokens, max_seq // 4)
        while True:
            head = [{"role": "system", "content": self.system}] if self.system else []
            ids = tok.encode(tok.apply_chat_template(head + self.messages), add_special_tokens=False)
            if len(ids) + room <= max_seq or len(self.messages) <= 1:
                return ids
            self.messages = self.messages[2:]          # a user message and its reply
            self.dropped += 1

    def reply(self, text: str) -> Iterator[str | Finished]:
        """Text pieces of the answer to `text`, then its Finished (cached_tokens: the prompt tokens reused)."""
        self.messages.append({"role": "user", "content": text})
        ids = self._prompt()
        self.scheduler.engine.check_fits(len(ids))
        room = self.scheduler.engine.max_seq - len(ids)
        params = replace(self.params, max_tokens=min(self.params.max_tokens, room))
        pieces = []
        for item in self.scheduler.stream(ids, params):
            if isinstance(item, Finished):
                self.messages.append({"role": "assistant", "content": "".join(pieces)})
            else:
                pieces.append(item)
            yield item


def chat(
    model: Annotated[str, typer.Option(help="Model name (smollm2-135m, gemma-3-270m), .gguf file or safetensors dir.")],
    system: Annotated[Optional[str], typer.Option(help="A system message to begin the conversation.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens in a reply.")] = 512,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Sample from the k most likely tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (1 = off).")] = 1.0,
    min_p: Annotated[float, typer.Option(help="Drop tokens less likely than min_p x the likeliest (0 = off).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    max_seq: Annotated[Optional[int], typer.Option(
        help="Context of the conversation in tokens (default: the model's, at most 4096).")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    ops: Annotated[Optional[str], typer.Option(help="Op implementations: kilnx, torch or auto.")] = None,
    quantize: Annotated[Optional[str], typer.Option(
        help="Quantize a dense checkpoint's linears as it loads: q4, q8, mxfp4, nvfp4 (kilnx convert writes them once).")] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help=_KV_HELP)] = "auto",
    stats: Annotated[bool, typer.Option(help="After each reply, print its tokens and the prompt tokens reused.")] = True,
    prompt_lookup: Annotated[bool, typer.Option(
        help="Speculative decoding, guessing from earlier in the conversation (vLLM's ngram method).")] = False,
    draft_model: Annotated[Optional[str], typer.Option(
        help="Speculative decoding, guessing with this smaller model of the same tokenizer.")] = None,
    num_draft_tokens: Annotated[int, typer.Option(help="Tokens guessed a speculative round.")] = 4,
) -> None:
    """Chat with a model in the terminal: type a message, Enter to send; /reset starts over, /exit (or EOF) ends."""
    from kilnx.models.loaders import load_model
    from kilnx.runtime.cli import _check_kv_cache_dtype, _fail, _proposer, _user_errors
    from kilnx.runtime.device import detect
    from kilnx.runtime.engine import Engine
    from kilnx.runtime.generate import default_stop_ids
    if max_seq is not None and max_seq < 16:
        _fail("--max-seq must be at least 16.")
    _check_kv_cache_dtype(kv_cache_dtype)
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                max_tokens=max_tokens)
    except ValueError as e:
        _fail(str(e))
    try:
        info = detect(device)
        ops = ops or os.environ.get("KILNX_OPS", "auto")
        lm = load_model(model, device=info.torch_device, ops=ops, quantize=quantize, progress=True)
        proposer = _proposer(lm, info, ops, prompt_lookup, draft_model, num_draft_tokens, params)
        engine = Engine(lm.model, max_seq=max_seq or min(lm.config.max_position_embeddings, 4096),
                        kv_cache_dtype=kv_cache_dtype)
        scheduler = Scheduler(engine, lm.tokenizer, stop_token_ids=default_stop_ids(lm), proposer=proposer)
    except _user_errors() as e:
        _fail(str(e))
    with scheduler:
        try:
            talk = Conversation(lm, scheduler, params, system)
        except _user_errors() as e:
            _fail(str(e))
        print(f"kilnx chat: {model} on {info.name}; /reset starts over, /exit ends.", file=sys.stderr)
        while True:
            sys.stdout.write(">>> ")
            sys.stdout.flush()
            line = sys.stdin.readline()
            if not line or line.strip() in ("/exit", "/quit"):
                break
            text = line.strip()
            if not text:
                continue
            if text == "/reset":
                talk.reset()
                continue
            dropped = talk.dropped
            try:
                print_stream(talk.reply(text), (lambda f: f"[{f.completion_tokens} tokens ({f.reason}); {f.cached_tokens} "
                                                          f"of {f.prompt_tokens} prompt tokens reused]") if stats else None)
            except _user_errors() as e:
                talk.messages.pop()
                print(f"error: {e}", file=sys.stderr)
            if talk.dropped > dropped:
                print(f"[dropped the oldest {talk.dropped - dropped} turn(s) to fit the context]", file=sys.stderr)
