"""A request as the scheduler holds it, and what it tells its listener: text pieces, log-probabilities, its end.
Also the stop-string rule (`split_at_stop`), which is the scheduler's part of OpenAI's `stop`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from kilnx.runtime.sampling import Sampler, SamplingParams
from kilnx.runtime.speculative import Pacing

Listener = Callable[[str, object], None]
"""on_event(kind, payload), called on the scheduler's thread: ("text", str) pieces of the continuation (and, where
asked, ("logprobs", [TokenLogprob]) before each token's text), then one ("done", Finished) or ("error", str). It
must not block (put the event on a queue)."""


@dataclass(frozen=True)
class Finished:
    reason: str                    # "stop" (a stop token or string), "length" (max_tokens or the context), "cancelled"
    prompt_tokens: int
    token_ids: tuple[int, ...]     # every sampled token, a final stop token included
    cached_tokens: int = 0         # prompt tokens whose K/V was reused: kept in its row, or copied from another

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class TokenLogprob:
    """A token with its log-probability under the model (log-softmax of the raw logits, before temperature and
    filters) and the `top` most likely tokens there; a prompt's first token has none (nothing predicts it)."""
    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, targets: list[int], top: int | None) -> list[TokenLogprob]:
    """Each logits row's log-softmax at its target token, with the `top` most likely tokens."""
    if not targets:
        return []
    lp = torch.log_softmax(logits.reshape(len(targets), -1).float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
    alts = [()] * len(targets)
    if top:
        vals, idx = lp.topk(top, dim=-1)
        alts = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return [TokenLogprob(t, c, a) for t, c, a in zip(targets, chosen, alts)]


def split_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str, bool]:
    """(safe, held, stopped) for text not yet emitted. stopped: a stop string occurs, and safe is the text
    before the one that ends first (the one a token-by-token generation completes first, however the text
    is cut into pieces; ties: the longer). Otherwise safe may be emitted now and held is the longest tail of
    text that could still be the start of a stop string (emitting it could leak part of a stop string)."""
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    if hits:
        return text[:min(hits)[1]], "", True
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if s.startswith(text[len(text) - n:]):
                hold = n
                break
    return text[:len(text) - hold], text[len(text) - hold:], False


@dataclass(eq=False)
class Request:
    ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    on_event: Listener
    tokens: list[int] = field(default_factory=list)
    held: str = ""                 # decoded text not yet emitted: it could begin a stop string
    cancelled: bool = False
    row: int | None = None
    admitted: int = 0              # the order rows were given in: prefill chunks go oldest first
    prefilled: int = 0             # prompt tokens already in the cache
    cached: int = 0                # of those, how many were reused (kept in the row, or copied from another)
    sampler: Sampler | None = None
    decoder: object = None
    fed: int = 0                   # decode steps enqueued: the next one feeds position len(ids) + fed
    inflight: int = 0              # of those, steps whose token the host has not read yet (lookahead)
    copy_from: "Request | None" = None   # the busy request whose prompt prefix this one's row will copy
    copy_len: int = 0
    logprobs: int | None = None    # with log-probabilities of each token and this many alternatives; None: without
    echo: bool = False             # the prompt's tokens' log-probabilities too (with logprobs)
    constraint: object = None      # a GrammarConstraint where params.grammar is set (runtime/structured.py)
    proposer: object = None        # its own speculative proposer, where the scheduler's forks (runtime/speculative.py)
    pacing: Pacing = field(default_factory=Pacing)   # when its turns are speculative rounds (with a proposer)

    def cancel(self) -> None:
        """Ask the scheduler to drop this request (its row frees at the next step); safe from any thread."""
        self.cancelled = True

    def spent(self, max_seq: int, inflight: int = 0) -> bool:
        """Whether this request has all the tokens it may have (max_tokens, or the context's end), counting
        `inflight` tokens of steps whose token is not read yet."""
        have = len(self.tokens) + inflight
        return have >= self.params.max_tokens or len(self.ids) + have >= max_seq

    def wants_step(self, max_seq: int) -> bool:
        """Whether another decode step can still give this request a token it may keep."""
        return bool(self.tokens) and not self.spent(max_seq, self.inflight)
