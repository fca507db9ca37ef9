"""Speculative decoding: a cheap proposer guesses the next k tokens, one forward of the model over k + 1
positions checks them (Engine.verify), and the round keeps the guesses the model agrees with plus one token of
the model's own — up to k + 1 tokens for about the price of one decode step, since a decode step's time is
reading the weights, which k + 1 rows read once.

Proposers (what vLLM and mlx-lm users know):
- PromptLookup — vLLM's "ngram" method, HF's prompt lookup: the tokens that followed the most recent earlier
  occurrence of the sequence's last n tokens (n from `max_ngram` down to `min_ngram`) in the prompt and output.
  Free, and right where the answer repeats its input (edits of code or text, extraction, summaries).
- DraftModel — mlx-lm's `--draft-model`: a small model of the same vocabulary decodes k tokens greedily on a
  cache of its own.

The kept tokens follow the model's distribution exactly (speculative sampling: Leviathan et al. 2023, Chen et
al. 2023), here with a proposal that is one token: a guessed token t is kept with probability p(t), p being
what the Sampler would sample from at that position given the tokens before it (penalties, bias, temperature,
top-k / top-p all applied); on rejection the position's token is drawn from p without t, renormalized, and the
round ends. Greedy (temperature 0) keeps a guess while it is the argmax, so the tokens are plain greedy
decoding's (to the rounding by which a k + 1-row forward's logits may differ from a one-row step's).
"""

from __future__ import annotations

import torch

from kilnx.runtime.sampling import Sampler


class PromptLookup:
    """Guesses from earlier in the sequence: the continuation of the latest earlier occurrence of its last
    n tokens. `begin` starts a sequence, which then only grows between proposals: its n-grams are indexed as it
    grows, so a proposal costs the new tokens, not the history."""

    def __init__(self, num_draft: int = 4, *, max_ngram: int = 3, min_ngram: int = 1):
        if num_draft < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs num_draft >= 1 and 1 <= min_ngram <= max_ngram; got "
                             f"{num_draft}, {min_ngram}, {max_ngram}.")
        self.num_draft, self.max_ngram, self.min_ngram = num_draft, max_ngram, min_ngram
        self.begin()

    def fork(self) -> "PromptLookup":
        """A proposer of the same settings for another sequence (the scheduler keeps one a request)."""
        return PromptLookup(self.num_draft, max_ngram=self.max_ngram, min_ngram=self.min_ngram)

    def begin(self, target_engine=None) -> None:
        self._last_end: dict[tuple[int, ...], int] = {}   # n-gram -> where its latest occurrence ended
        self._indexed = 0                                  # n-grams ending before this index are in _last_end

    def propose(self, tokens: list[int], k: int) -> list[int]:
        last = len(tokens) - 1
        for end in range(self._indexed, last):             # every n-gram ending before the last token
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._last_end[tuple(tokens[end - n + 1:end + 1])] = end
        self._indexed = max(self._indexed, last)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            end = self._last_end.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k]
        return []


class DraftModel:
    """Guesses from a smaller model of the same vocabulary, greedily, on its own Engine (row 0, as long a context
    as the target's). `begin` starts a sequence, which then only grows between proposals. The draft's cache holds
    the sequence as it was at the last proposal and the guesses fed after it; what the model did not keep of
    them is read again."""

    def __init__(self, model, num_draft: int = 4):
        if num_draft < 1:
            raise ValueError(f"a draft model needs num_draft >= 1, got {num_draft}.")
        self.model, self.num_draft = model, num_draft
        self.engine = None

    def fork(self) -> None:
        """None: one draft cache, so one sequence at a time (the scheduler's rounds then run for a row alone)."""
        return None

    def begin(self, target_engine) -> None:
        """A cache for sequences as long as `target_engine`'s, empty."""
        from kilnx.runtime.engine import Engine
        max_seq = min(target_engine.max_seq, self.model.config.max_position_embeddings)
        if self.engine is None or self.engine.max_seq < max_seq:
            self.engine = Engine(self.model, max_seq=max_seq)
        self._base, self._guesses_fed = 0, []    # the cache holds sequence[:_base] + _guesses_fed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        e = self.engine
        if len(tokens) + k - 1 > e.max_seq:
            return []
        keep = self._base
        for guess, tok in zip(self._guesses_fed, tokens[self._base:]):
            if guess != tok:
                break
            keep += 1
        keep = min(keep, len(tokens) - 1)                 # the last token is read now, for its logits
        if keep == len(tokens) - 1:
            logits = e.decode(torch.tensor(tokens[keep:], device=e.device), torch.tensor([keep], device=e.device),
                              max_position=keep)[0]
        else:
            logits = e.prefill(tokens[keep:], row=0, start=keep)
        out = []
        for i in range(k):
            out.append(int(torch.argmax(logits)))
            if i + 1 < k:
                pos = len(tokens) + i
                logits = e.decode(torch.tensor(out[-1:], device=e.device), torch.tensor([pos], device=e.device),
                                  max_position=pos)[0]
        self._base, self._guesses_fed = len(tokens), out[:-1]
        return out


class Pacing:
    """Whether a sequence's next turn is a speculative round. A check of 1 + k tokens costs 1.4-2.1x a decode step
    of llama-3.1-8b on the H200 and 1.6-3.1x one of SmolLM2-135M on the CPU at k = 1-4
    (bench/results/2026-12-05_*_speculative_s25.csv), so
    rounds whose guesses are mostly wrong are slower than plain steps: a sequence whose estimated chance of a
    guess being kept falls under `min_rate` takes plain steps, `wait` of them (doubling, up to 64, while the
    chance stays low), then one round to look again.

    The chance is the guesses kept over guesses kept and rejected (a round rejects at most one: the geometric
    acceptance model of the speculative-sampling papers), both decayed a round so that it follows the text."""

    def __init__(self, min_rate: float = 0.5, decay: float = 0.8):
        self.min_rate, self.decay = min_rate, decay
        self.kept = self.rejected = 0.0
        self.wait = 1              # plain steps the next low estimate buys
        self.idle = 0              # plain steps still to take before the next round

    @property
    def rate(self) -> float:
        seen = self.kept + self.rejected
        return self.kept / seen if seen else 1.0

    def ready(self) -> bool:
        """Whether this turn is a round; False counts the turn as one of the plain steps owed."""
        if self.idle:
            self.idle -= 1
            return False
        return True

    def record(self, drafted: int, kept: int) -> None:
        """A round made `drafted` guesses, of which the model kept the first `kept`."""
        if not drafted:
            return
        self.kept = self.kept * self.decay + kept
        self.rejected = self.rejected * self.decay + (kept < drafted)
        if self.rate < self.min_rate:
            self.idle, self.wait = self.wait, min(2 * self.wait, 64)
        else:
            self.wait = 1


def check_draft(target_lm, draft_lm) -> None:
    """ValueError unless the draft model's tokens mean what the target's mean."""
    tv, dv = target_lm.config.vocab_size, draft_lm.config.vocab_size
    tt, dt = target_lm.tokenizer, draft_lm.tokenizer
    if tt is not None and dt is not None:
        probe = "Speculative check: 12 + 30 = 42."
        same = tt.encode(probe) == dt.encode(probe) and dv <= tv
    else:
        same = tt is None and dt is None and tv == dv
    if not same:
        raise ValueError(f"the draft model {draft_lm.source} does not share the target {target_lm.source}'s "
                         f"tokenizer (vocabularies of {dv} and {tv} tokens): give a draft of the same family.")


def accept(sampler: Sampler, logits: torch.Tensor, draft: list[int]) -> list[int]:
    """The tokens a round keeps: the guesses the model agrees with and one of its own; logits (len(draft) + 1,
    V) from the forward over [last token, *draft]. Each kept token is observed by the sampler (penalties,
    min_tokens) before the next position is judged."""
    out: list[int] = []
    for i, guess in enumerate(draft):
        x = sampler.shape(logits[i:i + 1])
        if sampler.params.greedy:
            tok = int(sampler.argmax(x)[0])
        else:
            p = sampler.probabilities(x)[0]
            u = torch.rand(1, generator=sampler.gen, device=sampler.device)
            if bool(u < p[guess]):
                tok = guess
            else:                          # rejected: the position's token from p without the guess
                rest = p.clone()
                rest[guess] = 0.0
                tok = int(torch.multinomial(rest / rest.sum(), 1, generator=sampler.gen))
        sampler.observe(torch.tensor([tok], device=sampler.device))
        out.append(tok)
        if tok != guess:
            return out
    tok = int(sampler(logits[len(draft):len(draft) + 1])[0])
    sampler.observe(torch.tensor([tok], device=sampler.device))
    return out + [tok]
