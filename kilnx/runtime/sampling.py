"""Token selection: greedy, temperature, top-k, top-p (nucleus), seeded; stop tokens.

Filtering works on fp32 logits and masks excluded tokens with -inf, so the support set of the
distribution that is sampled is exactly what the filters keep (tests check those sets).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    seed: int = 0
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False          # benchmarks generate a fixed number of tokens

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")

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


class Sampler:
    """Chooses next tokens from logits (B, V). One seeded generator per sampler: same seed, same tokens."""

    def __init__(self, params: SamplingParams, device="cpu", ops=None):
        self.params = params
        self.ops = ops
        self.gen = torch.Generator(device=torch.device(device)).manual_seed(params.seed)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampled from (after temperature, top-k, top-p), fp32 (B, V)."""
        p = self.params
        x = logits.float() / max(p.temperature, 1e-6)
        x = filter_top_k(x, p.top_k)
        x = filter_top_p(x, p.top_p)
        return torch.softmax(x, dim=-1)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 1:
            logits = logits.unsqueeze(0)
        if self.params.greedy:
            if self.ops is not None:
                return self.ops.argmax(logits)
            return torch.argmax(logits, dim=-1)
        probs = self.probabilities(logits)
        return torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)

    def is_stop(self, token_id: int) -> bool:
        return (not self.params.ignore_eos) and token_id in self.params.stop_token_ids
