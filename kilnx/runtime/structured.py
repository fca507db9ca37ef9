"""Structured output: tokens constrained to a grammar (a JSON schema, any JSON object, a regex, a choice).

The grammar engine is llguidance (the library vLLM and others use for this): given the tokenizer, it says after
each token which tokens may come next, as a bitmask over the vocabulary. Here the mask is moved to the logits'
device and the disallowed tokens' logits set to -inf before temperature, filters and sampling, so the
distribution sampled is the model's restricted to the grammar. The matcher advances on the host by the sampled
token, so a constrained request's steps are not looked past (the scheduler reads each token before the next
step). When the grammar is complete only the stop tokens are allowed.
"""

from __future__ import annotations

import json
import re

import torch

_TOKENIZERS: dict[tuple, object] = {}   # (id(kilnx Tokenizer), vocab, stop ids) -> llguidance LLTokenizer (~1 s to build)


class GrammarError(ValueError):
    """A grammar or schema llguidance cannot compile (the request's fault)."""


def _llguidance():
    try:
        import llguidance
    except ImportError as e:
        raise GrammarError(f"structured output needs llguidance ({e}); install it with: pip install 'kilnx[serve]'.")
    return llguidance


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    return json_schema_grammar({"type": "object"})


def _checked(grammar: str, what: str) -> str:
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"the {what} cannot be used: {error}")
    return grammar


def json_schema_grammar(schema: dict | str) -> str:
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema if isinstance(schema, str) else json.dumps(schema))
    except Exception as e:   # llguidance raises ValueError / RuntimeError with the reason
        raise GrammarError(f"the JSON schema cannot be used: {e}") from e
    return _checked(grammar, "JSON schema")


def regex_grammar(pattern: str) -> str:
    return _checked(_llguidance().LLMatcher.grammar_from_regex(pattern), "regex")


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of `choices` (vLLM's guided_choice)."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("a choice needs a non-empty list of strings.")
    return regex_grammar("|".join(f"({re.escape(c)})" for c in choices))


def _tokenizer_for(tokenizer, vocab: int, stop_ids: tuple[int, ...]):
    key = (id(tokenizer), vocab, tuple(stop_ids))
    got = _TOKENIZERS.get(key)
    if got is None:
        llg = _llguidance()
        got = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab,
                              eos_token=list(stop_ids) if stop_ids else None)
        _TOKENIZERS[key] = got
    return got


class GrammarConstraint:
    """The logits mask of one sequence under `grammar` (one of the *_grammar strings above)."""

    def __init__(self, tokenizer, grammar: str, vocab: int, stop_ids: tuple[int, ...]):
        if tokenizer is None:
            raise GrammarError("structured output needs the model's tokenizer, and this model has none.")
        llg = _llguidance()
        self.vocab = vocab
        try:
            self.matcher = llg.LLMatcher(_tokenizer_for(tokenizer, vocab, stop_ids), grammar, log_level=0)
        except Exception as e:
            raise GrammarError(f"the grammar cannot be used: {e}") from e
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {self.matcher.get_error()}")

    def allowed(self, device="cpu") -> torch.Tensor:
        """(vocab,) bool on `device`: the tokens the grammar allows next (the bitmask's words moved, then unpacked
        there: V/8 bytes cross, not V)."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32).to(device)
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32, device=words.device)) & 1
        return bits.reshape(-1)[:self.vocab].bool()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (1, V) with what the grammar forbids at -inf (fp32)."""
        return logits.float().masked_fill(~self.allowed(logits.device), -torch.inf)

    def accept(self, token: int) -> None:
        """Advance by the token sampled (a token the mask allowed; a stop token once complete)."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_accepting()
