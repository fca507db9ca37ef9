"""Streaming generation: yields text pieces as tokens are produced, then a GenerationStats.

    for item in stream(lm, "Hello", SamplingParams(max_tokens=32)):
        if isinstance(item, str): print(item, end="")
        else: stats = item

Timing: TTFT covers prompt processing and the first sampled token; decode tok/s counts the tokens
after the first over the time after the first (the steady-state rate of one-token steps).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from kilnx.runtime.engine import Engine
from kilnx.runtime.sampling import Sampler, SamplingParams


@dataclass
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    total_s: float
    stop_reason: str                 # "stop_token" | "max_tokens" | "context"
    token_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("token_ids")
        return d


def prompt_ids(lm, prompt: str | list[int], *, chat: bool = False) -> list[int]:
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if lm.tokenizer is None:
        from kilnx.models.errors import ModelError
        raise ModelError(f"{lm.source}: no tokenizer available to encode a text prompt.")
    return lm.tokenizer.encode_chat(prompt) if chat else lm.tokenizer.encode(prompt)


def generate_ids(engine: Engine, ids: list[int], params: SamplingParams) -> Iterator[int | GenerationStats]:
    """Token ids one by one, then stats. Single sequence in cache row 0."""
    engine.check_fits(len(ids))
    budget = min(params.max_tokens, engine.max_seq - len(ids))
    sampler = Sampler(params, device=engine.device, ops=engine.model.ops)
    stops = set(params.stop_token_ids)
    t0 = time.perf_counter()
    out: list[int] = []
    reason = "max_tokens"
    ttft = decode_start = 0.0
    if budget <= 0:
        engine.synchronize()
        yield GenerationStats(len(ids), 0, 0.0, 0.0, 0.0, time.perf_counter() - t0,
                              "context" if params.max_tokens else "max_tokens")
        return
    logits = engine.prefill(ids)
    tok = int(sampler(logits)[0])
    ttft = time.perf_counter() - t0
    decode_start = time.perf_counter()
    pos = len(ids)
    step_tok = torch.empty(1, dtype=torch.long, device=engine.device)
    step_pos = torch.empty(1, dtype=torch.long, device=engine.device)
    while True:
        out.append(tok)
        yield tok
        if tok in stops and not params.ignore_eos:
            reason = "stop_token"
            break
        if len(out) >= budget:
            reason = "max_tokens" if len(out) >= params.max_tokens else "context"
            break
        step_tok.fill_(tok)
        step_pos.fill_(pos)
        logits = engine.decode(step_tok, step_pos)
        tok = int(sampler(logits)[0])
        pos += 1
    end = time.perf_counter()
    n_after = len(out) - 1
    yield GenerationStats(
        prompt_tokens=len(ids), generated_tokens=len(out), ttft_s=ttft,
        prefill_tok_s=len(ids) / ttft if ttft > 0 else 0.0,
        decode_tok_s=n_after / (end - decode_start) if n_after > 0 and end > decode_start else 0.0,
        total_s=end - t0, stop_reason=reason, token_ids=out)


def stream(lm, prompt: str | list[int], params: SamplingParams | None = None, *, chat: bool = False,
           engine: Engine | None = None) -> Iterator[str | GenerationStats]:
    """Text pieces of the continuation of `prompt` (model from kilnx.models.loaders.load_model), then stats."""
    params = params or SamplingParams()
    if not params.stop_token_ids and not params.ignore_eos:
        stop = tuple(lm.config.eos_token_ids) or (lm.tokenizer.eos_token_ids if lm.tokenizer else ())
        params = SamplingParams(**{**asdict(params), "stop_token_ids": tuple(stop)})
    ids = prompt_ids(lm, prompt, chat=chat)
    engine = engine or Engine(lm.model, max_seq=min(lm.config.max_position_embeddings,
                                                    len(ids) + params.max_tokens + 1))
    decoder = lm.tokenizer.stream_decoder() if lm.tokenizer is not None else None
    for item in generate_ids(engine, ids, params):
        if isinstance(item, GenerationStats):
            if decoder is not None:
                tail = decoder.flush()
                if tail:
                    yield tail
            yield item
            return
        if decoder is not None:
            piece = decoder.push(item)
            if piece:
                yield piece


def generate_text(lm, prompt: str | list[int], params: SamplingParams | None = None, *, chat: bool = False):
    """(text, stats) — the non-streaming convenience."""
    pieces, stats = [], None
    for item in stream(lm, prompt, params, chat=chat):
        if isinstance(item, str):
            pieces.append(item)
        else:
            stats = item
    return "".join(pieces), stats
