"""Streaming generation: yields text pieces as tokens are produced, then a GenerationStats.

    for item in stream(lm, "Hello", SamplingParams(max_tokens=32)):
        if isinstance(item, str): print(item, end="")
        else: stats = item

Timing: TTFT covers prompt processing and the first sampled token; decode tok/s counts the tokens
after the first over the time after the first (the steady-state rate of one-token steps).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from kilnx.runtime.engine import Engine
from kilnx.runtime.sampling import Sampler, SamplingParams
from kilnx.runtime.speculative import Pacing, accept


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
    drafted: int = 0                 # speculative decoding: tokens guessed, and of those kept
    accepted: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("token_ids")
        return d


def prompt_ids(lm, prompt: str | list[int], *, chat: bool = False, system: str | None = None) -> list[int]:
    """The prompt's token ids: `chat` wraps it (after a `system` message, if given) in the chat template."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if lm.tokenizer is None:
        from kilnx.models.errors import ModelError
        raise ModelError(f"{lm.source}: no tokenizer available to encode a text prompt.")
    return lm.tokenizer.encode_chat(prompt, system) if chat else lm.tokenizer.encode(prompt)


def generate_ids(engine: Engine, ids: list[int], params: SamplingParams, *,
                 proposer=None) -> Iterator[int | GenerationStats]:
    """Token ids one by one, then stats. Single sequence in cache row 0. With a `proposer`
    (runtime/speculative.py), decoding is speculative."""
    if proposer is not None:
        engine.check_rewindable()
    if proposer is not None and params.grammar is not None:
        raise ValueError("speculative decoding does not take a grammar: drop the draft model / prompt lookup or "
                         "the schema.")
    engine.check_fits(len(ids))
    budget = min(params.max_tokens, engine.max_seq - len(ids))
    sampler = Sampler(params, device=engine.device, ops=engine.model.ops)
    sampler.start(ids, engine.config.vocab_size)
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
    first = sampler(logits)
    sampler.observe(first[:1])
    tok = int(first[0])
    ttft = time.perf_counter() - t0
    decode_start = time.perf_counter()
    if proposer is None:
        steps = _StepQueue(engine, sampler, first[:1], len(ids), budget, lookahead=_lookahead(engine))
        next_tokens = lambda: [steps.token(len(out))]   # noqa: E731
    else:
        rounds = _Speculation(engine, sampler, proposer, ids + [tok])
        next_tokens = lambda: rounds.tokens(budget - len(out))   # noqa: E731
    pending = [tok]
    while pending:
        tok = pending.pop(0)
        out.append(tok)
        yield tok
        if tok in stops and not params.ignore_eos:
            reason = "stop_token"
            break
        if len(out) >= budget:
            reason = "max_tokens" if len(out) >= params.max_tokens else "context"
            break
        if not pending:
            pending = next_tokens()
    end = time.perf_counter()
    n_after = len(out) - 1
    yield GenerationStats(
        prompt_tokens=len(ids), generated_tokens=len(out), ttft_s=ttft,
        prefill_tok_s=len(ids) / ttft if ttft > 0 else 0.0,
        decode_tok_s=n_after / (end - decode_start) if n_after > 0 and end > decode_start else 0.0,
        total_s=end - t0, stop_reason=reason, token_ids=out,
        **({"drafted": rounds.drafted, "accepted": rounds.accepted} if proposer is not None else {}))


class _Speculation:
    """Speculative rounds after the prefill: each guesses up to k tokens, checks them in one forward over the
    last token and the guesses, and returns the tokens kept (runtime/speculative.py). A round with no guess (none
    found, or none asked for while the guesses are mostly wrong: Pacing) is a plain decode step. Synchronous: the
    host reads each round's tokens before guessing the next."""

    def __init__(self, engine: Engine, sampler: Sampler, proposer, sequence: list[int]):
        self.engine, self.sampler, self.proposer = engine, sampler, proposer
        self.seq = list(sequence)             # the prompt and the tokens so far; the last is not in the cache yet
        self.drafted = self.accepted = 0
        self.pacing = Pacing()
        proposer.begin(engine)

    def tokens(self, room: int) -> list[int]:
        pos, last = len(self.seq) - 1, self.seq[-1]
        k = min(self.proposer.num_draft, room - 1)
        draft = self.proposer.propose(self.seq, k) if k > 0 and self.pacing.ready() else []
        if not draft:
            e = self.engine
            logits = e.decode(torch.tensor([last], device=e.device), torch.tensor([pos], device=e.device),
                              max_position=pos)
        else:
            logits = self.engine.verify([last, *draft], row=0, start=pos)
        kept = accept(self.sampler, logits, draft)
        self.pacing.record(len(draft), len(kept) - 1)
        self.drafted += len(draft)
        self.accepted += len(kept) - 1
        self.seq += kept
        return kept


def _lookahead(engine: Engine) -> int:
    """Decode steps enqueued ahead of the token the host reads: 1 on a GPU, 0 on the CPU (_StepQueue says
    why); KILNX_DECODE_LOOKAHEAD overrides, for A/B runs."""
    env = os.environ.get("KILNX_DECODE_LOOKAHEAD")
    if env is None:
        return int(engine.device.type == "cuda")
    if not env.strip().isdigit():
        raise ValueError(f"KILNX_DECODE_LOOKAHEAD={env!r}: give a number of steps (0 = no lookahead, 1 = the "
                         "GPU default) or unset it.")
    return int(env)


class _StepQueue:
    """Decode steps kept `lookahead` steps ahead of the host.

    Each step's input token is the previous step's sampled token, fed on the device (copy into the step's
    input, position + 1), and its own token comes back through a non-blocking copy. So on a GPU the host
    enqueues step n + 1 before it reads step n's token and the GPU never waits for the host's per-token
    work (the synchronous loop left it idle between steps while the host read the token back, checked it,
    and launched the next step's input copies). The price is one step computed past a stop token, whose
    K/V lands beyond the sequence's end, where nothing reads it. On the CPU the kernels run as they are
    launched, so a step ahead would only add a wasted step: lookahead 0 there."""

    def __init__(self, engine: Engine, sampler: Sampler, first: torch.Tensor, position: int, budget: int,
                 lookahead: int):
        self.engine, self.sampler, self.lookahead = engine, sampler, lookahead
        self.budget = budget                                  # tokens in all, the prefill's included
        # the next step's input, on the device: the captured step's own buffers where there is one
        self.tok, self.pos = engine.decode_inputs(1) or (torch.empty(1, dtype=torch.long, device=engine.device),
                                                         torch.empty(1, dtype=torch.long, device=engine.device))
        self.tok.copy_(first.reshape(1))
        self.pos.fill_(position)
        self.first_position = position
        cuda = engine.device.type == "cuda"
        self.host = torch.empty(max(budget, 1), dtype=torch.long, pin_memory=cuda)
        self.done: list = []                                  # per enqueued step: its event (None on the CPU)

    def _enqueue(self) -> None:
        i = len(self.done)
        logits = self.engine.decode(self.tok, self.pos, max_position=self.first_position + i)
        nxt = self.sampler(logits)[:1]
        self.sampler.observe(nxt)                             # penalties count it (on the device)
        self.tok.copy_(nxt)
        self.pos.add_(1)
        self.host[i + 1:i + 2].copy_(nxt, non_blocking=True)
        ev = None
        if self.engine.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
        self.done.append(ev)

    def token(self, n: int) -> int:
        """Token number n (0 is the prefill's), enqueueing the steps up to it and `lookahead` beyond."""
        want = min(n + self.lookahead, self.budget - 1)       # step i makes token i + 1
        while len(self.done) < want:
            self._enqueue()
        if self.done[n - 1] is not None:
            self.done[n - 1].synchronize()
        return int(self.host[n])


def default_stop_ids(lm) -> tuple[int, ...]:
    """The tokens that end a generation: the config's EOS ids, else the tokenizer's."""
    return tuple(lm.config.eos_token_ids) or (tuple(lm.tokenizer.eos_token_ids) if lm.tokenizer else ())


def stream(lm, prompt: str | list[int], params: SamplingParams | None = None, *, chat: bool = False,
           engine: Engine | None = None, proposer=None, kv_cache_dtype: str = "auto") -> Iterator[str | GenerationStats]:
    """Text pieces of the continuation of `prompt` (model from kilnx.models.loaders.load_model), then stats;
    speculative with a `proposer` (runtime/speculative.py)."""
    params = params or SamplingParams()
    if not params.stop_token_ids and not params.ignore_eos:
        params = SamplingParams(**{**asdict(params), "stop_token_ids": default_stop_ids(lm)})
    ids = prompt_ids(lm, prompt, chat=chat)
    engine = engine or Engine(lm.model, max_seq=min(lm.config.max_position_embeddings,
                                                    len(ids) + params.max_tokens + 1), kv_cache_dtype=kv_cache_dtype)
    decoder = lm.tokenizer.stream_decoder() if lm.tokenizer is not None else None
    for item in generate_ids(engine, ids, params, proposer=proposer):
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
