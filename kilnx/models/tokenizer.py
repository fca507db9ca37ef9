"""Tokenizer: a `tokenizers` Tokenizer from tokenizer.json or rebuilt from a GGUF vocabulary, the chat
template (jinja2), and an incremental detokenizer for streaming.

GGUF vocabularies: "gpt2" (byte-level BPE with the file's merges, pre-tokenizer regex chosen by
tokenizer.ggml.pre) and "llama" (sentencepiece; merges recovered from the vocabulary, byte fallback).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from kilnx.models.errors import CheckpointError

# Pre-tokenizer split patterns by tokenizer.ggml.pre (the pattern each vocabulary's merges were learned on).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable latin-1 bytes map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


@dataclass
class Tokenizer:
    backend: object                       # tokenizers.Tokenizer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos: bool = False                 # prepend BOS ourselves (GGUF-built tokenizers have no post-processor)
    chat_template: str | None = None
    special_tokens: dict = field(default_factory=dict)   # bos_token / eos_token strings for the template

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dir(cls, path: str, eos_token_ids: tuple[int, ...] = (), bos_token_id: int | None = None):
        from tokenizers import Tokenizer as TK
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise CheckpointError(f"{path}: no tokenizer.json; copy it from the model's repository next to the weights.")
        backend = TK.from_file(tj)
        conf = {}
        tc = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(tc):
            with open(tc) as f:
                conf = json.load(f)
        template = conf.get("chat_template")
        jt = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jt):
            with open(jt) as f:
                template = f.read()
        specials = {k: _token_str(conf.get(k)) for k in ("bos_token", "eos_token") if conf.get(k)}
        if bos_token_id is None and specials.get("bos_token"):
            bos_token_id = backend.token_to_id(specials["bos_token"])
        eos = tuple(eos_token_ids)
        if not eos and specials.get("eos_token"):
            eos = (backend.token_to_id(specials["eos_token"]),)
        # tokenizer.json's post-processor adds BOS itself where the model wants one.
        return cls(backend, bos_token_id, eos, add_bos=False, chat_template=template, special_tokens=specials)

    @classmethod
    def from_gguf_metadata(cls, meta: dict, source: str = "model.gguf"):
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise CheckpointError(f"{source}: the GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens).")
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre"))
        elif kind == "llama":
            backend = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores"), meta)
        else:
            raise CheckpointError(f"{source}: tokenizer model {kind!r} is not supported (gpt2 and llama are).")
        _add_special(backend, tokens, types, byte_level=(kind == "gpt2"))
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
        eos = tuple(int(e) for e in dict.fromkeys(eos) if e is not None)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        specials = {}
        if bos is not None:
            specials["bos_token"] = tokens[int(bos)]
        if eos:
            specials["eos_token"] = tokens[eos[0]]
        return cls(backend, None if bos is None else int(bos), eos, add_bos=add_bos,
                   chat_template=meta.get("tokenizer.chat_template"), special_tokens=specials)

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **extra) -> str:
        """The template rendered over `messages`; `extra` are more variables it may use (e.g. `tools`)."""
        if not self.chat_template:
            raise CheckpointError("this model has no chat template; run without --chat.")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise ValueError(msg)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **extra)

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": prompt}]
        text = self.apply_chat_template(messages)
        # The template already writes BOS where the model wants it.
        return self.encode(text, add_special_tokens=False)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


def _token_str(v):
    return v.get("content") if isinstance(v, dict) else v


class StreamDecoder:
    """Turns a growing id sequence into text pieces, at a per-token cost independent of history.

    It decodes only a short window of recent ids: the text of ids[prefix:read] (already emitted)
    and of ids[prefix:]; the difference is new. A piece ending in U+FFFD is an incomplete UTF-8
    sequence (a multi-byte character split across tokens) and is held back until completed.
    Decoding from `prefix` rather than from `read` keeps context that tokenizers need to place
    spaces (sentencepiece strips the leading space of a sequence's first token).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def _text(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self._text(self.ids[self.prefix:self.read])
        now = self._text(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            piece = now[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            return piece
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. a trailing incomplete character) at the end of a stream."""
        before = self._text(self.ids[self.prefix:self.read])
        now = self._text(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):] if len(now) > len(before) else ""


def _byte_level_bpe(tokens, merges, pre):
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as TK
    alphabet = _byte_alphabet()
    chars = set(alphabet.values())
    vocab = {}
    for i, t in enumerate(tokens):
        # A few converters store tokens in raw UTF-8 rather than the byte alphabet; re-spell those.
        spelled = t if set(t) <= chars else "".join(alphabet[b] for b in t.encode("utf-8"))
        vocab.setdefault(spelled, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = TK(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    split = _SPLITS.get(pre)
    if split:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens, scores, meta):
    """Sentencepiece BPE as a `tokenizers` BPE: merges recovered from the vocabulary.

    A merge (l, r) exists when l, r and l+r are all tokens; merges are ranked by the merged token's
    priority. Gemma's scores do not follow its merge order while its token order does, so gemma
    vocabularies rank by position, others by score.
    """
    from tokenizers import decoders, models, normalizers
    from tokenizers import Tokenizer as TK
    # Tokens made only of spaces are stored with real spaces; the model sees them as "▁".
    toks = ["\u2581" * len(t) if _spaces(t) else t for t in tokens]
    vocab = {}
    for i, t in enumerate(toks):
        vocab.setdefault(t, i)
    by_position = meta.get("general.architecture", "").startswith("gemma") or scores is None
    priority = {t: (-i if by_position else float(scores[i])) for i, t in enumerate(toks)}
    found = []
    for t, prio in priority.items():
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in vocab and right in vocab:
                found.append((prio, vocab[left], vocab[right], left, right))
    found.sort(key=lambda m: (-m[0], m[1], m[2]))
    merges = [(m[3], m[4]) for m in found]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = TK(models.BPE(vocab=vocab, merges=merges, unk_token=None if unk is None else toks[int(unk)],
                            fuse_unk=True, byte_fallback=True))
    steps = []
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        steps.append(normalizers.Prepend("\u2581"))
    steps.append(normalizers.Replace(" ", "\u2581"))
    backend.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        dec.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(dec)
    return backend


def _spaces(t: str) -> bool:
    """A token made only of spaces (sentencepiece vocabularies store those with real spaces)."""
    return bool(t) and not t.strip(" ")


def _add_special(backend, tokens, types, *, byte_level: bool):
    from tokenizers import AddedToken
    chars = set(_byte_alphabet().values()) if byte_level else None
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
               if ty == _CONTROL and (chars is None or set(t) <= chars)]
    if special:
        backend.add_special_tokens(special)
    # sentencepiece vocabularies hold runs of spaces as "▁▁..." (see _sentencepiece_bpe): such a user-defined token
    # matches the normalized text, so it keeps its vocabulary id (gemma's "  " is 138; added as raw spaces, it had
    # taken a new id past the embedding, 262144)
    user = [AddedToken("\u2581" * len(t), special=False, normalized=True) if _spaces(t) and not byte_level
            else AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if user:
        backend.add_tokens(user)
