"""Token selection: greedy, temperature, top-k, top-p (nucleus), min-p, seeded; stop tokens.

Filtering works on fp32 logits and masks excluded tokens with -inf, so the support set of the
distribution that is sampled is exactly what the filters keep (tests check those sets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    min_p: float = 0.0                # vLLM's / mlx-lm's: drop tokens less likely than min_p x the likeliest (0 = off)
    seed: int = 0
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False          # benchmarks generate a fixed number of tokens
    presence_penalty: float = 0.0     # OpenAI's: subtracted from a token's logit once it was generated
    frequency_penalty: float = 0.0    # OpenAI's: subtracted per time it was generated
    repetition_penalty: float = 1.0   # HF / vLLM's: a token of the prompt or the output has its logit divided
                                      # by it where positive, multiplied where negative (1 = off)
    logit_bias: tuple[tuple[int, float], ...] = ()   # OpenAI's: (token id, added to its logit), each in [-100, 100]
    min_tokens: int = 0               # vLLM's: the stop tokens cannot be chosen before this many were generated
    grammar: str | None = None        # llguidance grammar the tokens must follow (runtime/structured.py)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not -2.0 <= self.presence_penalty <= 2.0 or not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("presence_penalty and frequency_penalty must lie in [-2, 2] (OpenAI's range), got "
                             f"{self.presence_penalty} and {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must lie in [-100, 100] (OpenAI's range), got {self.logit_bias}")
        if any(t < 0 for t, _ in self.logit_bias):
            raise ValueError(f"logit_bias token ids must be >= 0, got {self.logit_bias}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def check_vocab(self, vocab: int) -> None:
        """ValueError if logit_bias names a token past a vocabulary of `vocab` tokens."""
        past = [t for t, _ in self.logit_bias if t >= vocab]
        if past:
            raise ValueError(f"logit_bias names token {past[0]}, past the vocabulary's {vocab} tokens")

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits are changed before choosing (penalties, a bias, stop tokens held back), so that a
        sequence needs its own Sampler started on its prompt and told each token it generates."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.grammar is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept too), mask the rest."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, -torch.inf)


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches p (at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p          # already reached p without this token
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -torch.inf)


def filter_min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the tokens at least p times as likely as the likeliest of their row (p x its probability), mask the
    rest; a ratio of probabilities, so the same before or after renormalizing."""
    if p <= 0.0:
        return logits
    floor = logits.max(dim=-1, keepdim=True).values + math.log(p)
    return logits.masked_fill(logits < floor, -torch.inf)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits (B, V) after the penalties of p: counts (B, V) how often each token was generated, seen (B, V)
    whether it is in the prompt or the output. fp32 out."""
    x = logits.float()
    if p.repetition_penalty != 1.0:
        x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    if p.frequency_penalty:
        x = x - p.frequency_penalty * counts
    if p.presence_penalty:
        x = x - p.presence_penalty * (counts > 0).float()
    return x


class Sampler:
    """Chooses next tokens from logits (B, V). One seeded generator per sampler: same seed, same tokens."""

    def __init__(self, params: SamplingParams, device="cpu", ops=None):
        self.params = params
        self.ops = ops
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(params.seed)
        self.counts = self.seen = None     # with penalties: (1, V) generated counts and prompt-or-output marks
        self.bias = None                   # with logit_bias: (1, V) added to the logits
        self.held = None                   # with min_tokens: (1, V) -inf at the stop tokens, 0 elsewhere
        self.generated = 0                 # tokens observed (min_tokens counts them)
        self.constraint = None             # with a grammar: its GrammarConstraint (set by the scheduler)

    def start(self, prompt: list[int], vocab: int, stop_token_ids: tuple[int, ...] = ()) -> None:
        """Begin a sequence after `prompt` (what repetition_penalty counts as seen). Needed where
        params.shapes_logits; `stop_token_ids` are those min_tokens holds back (beside params.stop_token_ids)."""
        p = self.params
        self.generated = 0
        if p.logit_bias:
            p.check_vocab(vocab)
            self.bias = torch.zeros(1, vocab, device=self.device)
            for t, b in p.logit_bias:
                self.bias[0, t] = b
        stops = sorted({t for t in (*p.stop_token_ids, *stop_token_ids) if 0 <= t < vocab})
        if p.min_tokens and stops:
            self.held = torch.zeros(1, vocab, device=self.device)
            self.held[0, stops] = -torch.inf
        if p.penalized:
            self.counts = torch.zeros(1, vocab, device=self.device)
            self.seen = torch.zeros(1, vocab, dtype=torch.bool, device=self.device)
            if self.params.repetition_penalty != 1.0:
                self.seen[0, torch.tensor(prompt, device=self.device)] = True

    def observe(self, token: torch.Tensor) -> None:
        """Count a generated token (a (1,) tensor, on the device: no host read)."""
        self.generated += 1
        if self.counts is not None:
            t = token.reshape(1).to(self.device)
            self.counts[0].index_add_(0, t, torch.ones(1, device=self.device))
            self.seen[0, t] = True

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampled from (after temperature, top-k, top-p, min-p: HF's order), fp32 (B, V)."""
        p = self.params
        x = logits.float() / max(p.temperature, 1e-6)
        x = filter_top_k(x, p.top_k)
        x = filter_top_p(x, p.top_p)
        x = filter_min_p(x, p.min_p)
        return torch.softmax(x, dim=-1)

    def shape(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits (B, V) as they are chosen from now: penalties, bias, stop tokens held back, a grammar's mask."""
        if logits.dim() == 1:
            logits = logits.unsqueeze(0)
        if self.counts is not None:
            logits = apply_penalties(logits, self.counts, self.seen, self.params)
        if self.bias is not None:
            logits = logits.float() + self.bias
        if self.held is not None and self.generated < self.params.min_tokens:
            logits = logits.float() + self.held
        if self.constraint is not None:
            logits = self.constraint.apply(logits)
        return logits

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self.ops.argmax(logits) if self.ops is not None else torch.argmax(logits, dim=-1)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = self.shape(logits)
        if self.params.greedy:
            return self.argmax(logits)
        probs = self.probabilities(logits)
        return torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)

    def is_stop(self, token_id: int) -> bool:
        return (not self.params.ignore_eos) and token_id in self.params.stop_token_ids
