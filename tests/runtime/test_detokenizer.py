"""The incremental detokenizer emits exactly the full decode, with per-token work bounded by a window."""

from __future__ import annotations

import pytest

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 3.14159 — naïve café, señor!",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tTabs\tand  double  spaces",
    "Emoji 😀🎉👩‍👩‍👧 and CJK 日本語のテキスト, Ελληνικά, עברית, русский текст.",
]


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from kilnx.models.loaders import open_source
    return open_source(smollm2_path)[2]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tok, text):
    ids = tok.encode(text)
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)     # never emits half a UTF-8 character


def test_window_stays_small(tok):
    """Per-token cost must not grow with history: the decoder only ever decodes a short window."""
    ids = tok.encode(" ".join(TEXTS) * 20)
    dec = tok.stream_decoder()
    longest = 0
    real_decode = tok.decode

    def spy(window, **kw):
        nonlocal longest
        longest = max(longest, len(window))
        return real_decode(window, **kw)

    tok.decode = spy
    try:
        out = "".join(dec.push(i) for i in ids) + dec.flush()
    finally:
        del tok.decode
    assert out == real_decode(ids)
    assert longest <= 16, longest
