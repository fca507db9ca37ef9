"""LSB-first packing of b-bit codes into little-endian uint32 words, the MLX layout.

Element i of a row occupies bits [i*b, (i+1)*b) of the row's bit stream, and bit t of
the stream is bit (t % 32) of word t // 32. For b in {3, 5, 6} a code can straddle two
words (MLX's CPU kernel writes the same stream byte by byte). For b = 4 this means
byte j holds element 2j in its low nibble, element 2j+1 in the high one.
"""

from __future__ import annotations

from math import gcd

import numpy as np

PACKABLE_BITS = (2, 3, 4, 5, 6, 8)


def _chunk(bits: int) -> tuple[int, int]:
    """Smallest run of codes that fills whole words: (codes per chunk, words per chunk)."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"cannot pack {bits}-bit codes; supported widths are {PACKABLE_BITS}")
    codes = 32 // gcd(bits, 32)
    return codes, codes * bits // 32


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack integer codes (..., K) with values < 2**bits into uint32 words (..., K*bits//32)."""
    n_codes, n_words = _chunk(bits)
    codes = np.asarray(codes)
    k = codes.shape[-1]
    if k % n_codes:
        raise ValueError(f"last axis {k} must be a multiple of {n_codes} to pack {bits}-bit codes")
    lead = codes.shape[:-1]
    if 8 % bits == 0:
        # whole codes per byte: OR each byte's codes together in uint8 and read the bytes as little-endian
        # words (byte j of a word is its bits 8j..8j+7). A GGUF load packs every weight this way: SmolLM2-135M
        # loaded in 0.75 s against 1.13 s through the general uint64 loop below (2 EPYC cores)
        per_byte = 8 // bits
        c = codes.reshape(-1, k).astype(np.uint8, copy=False)
        packed = c[:, 0::per_byte].copy()
        for j in range(1, per_byte):
            packed |= c[:, j::per_byte] << np.uint8(j * bits)
        return packed.view(np.dtype("<u4")).astype(np.uint32, copy=False).reshape(
            lead + (k * bits // 32,))
    c = codes.reshape(-1, k // n_codes, n_codes).astype(np.uint64)
    words = np.zeros(c.shape[:2] + (n_words,), dtype=np.uint64)
    for i in range(n_codes):  # constant trip count: at most 32 vectorised steps
        offset = i * bits
        w, s = divmod(offset, 32)
        words[..., w] |= (c[..., i] << np.uint64(s)) & np.uint64(0xFFFFFFFF)
        if s + bits > 32:  # the code straddles into the next word
            words[..., w + 1] |= c[..., i] >> np.uint64(32 - s)
    return words.astype(np.uint32).reshape(lead + (k * bits // 32,))


def unpack_bits(words: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of pack_bits: uint32 words (..., W) -> uint8 codes (..., W*32//bits)."""
    n_codes, n_words = _chunk(bits)
    words = np.asarray(words)
    if words.dtype not in (np.uint32, np.int32):
        raise ValueError(f"packed words must be uint32 (or int32 bits), got {words.dtype}")
    words = words.view(np.uint32)
    nw = words.shape[-1]
    if nw % n_words:
        raise ValueError(f"last axis {nw} must be a multiple of {n_words} words for {bits}-bit codes")
    lead = words.shape[:-1]
    w64 = words.reshape(-1, nw // n_words, n_words).astype(np.uint64)
    mask = np.uint64((1 << bits) - 1)
    codes = np.empty(w64.shape[:2] + (n_codes,), dtype=np.uint8)
    for i in range(n_codes):
        offset = i * bits
        w, s = divmod(offset, 32)
        v = w64[..., w] >> np.uint64(s)
        if s + bits > 32:
            v |= w64[..., w + 1] << np.uint64(32 - s)
        codes[..., i] = (v & mask).astype(np.uint8)
    return codes.reshape(lead + (nw * 32 // bits,))


def repack_words(words, bits: int, new_bits: int):
    """torch (..., W) int32 words of `bits`-bit codes -> the same codes packed `new_bits` wide (int32 words,
    the MLX layout), on the words' device. For widening a format the GEMVs cannot read (3/5/6-bit codes
    straddle words) into one they can, with the same scales and biases: exact."""
    import torch
    n_codes, n_words = _chunk(bits)
    _chunk(new_bits)
    lead, nw = tuple(words.shape[:-1]), words.shape[-1]
    if nw % n_words:
        raise ValueError(f"last axis {nw} must be a multiple of {n_words} words for {bits}-bit codes")
    w = words.reshape(-1, nw // n_words, n_words).to(torch.int64) & 0xFFFFFFFF
    mask = (1 << bits) - 1
    codes = []
    for i in range(n_codes):
        j, s = divmod(i * bits, 32)
        c = w[..., j] >> s
        if s + bits > 32:   # the code straddles into the next word
            c = c | (w[..., j + 1] << (32 - s))
        codes.append(c & mask)
    per = 32 // new_bits if 32 % new_bits == 0 else None
    if per is None:
        raise ValueError(f"repack_words widens into whole-word widths (2, 4, 8), not {new_bits}")
    codes = torch.stack(codes, -1).reshape(-1, nw * 32 // bits // per, per)
    out = torch.zeros(codes.shape[:-1], dtype=torch.int64, device=words.device)
    for i in range(per):
        out |= codes[..., i] << (i * new_bits)
    out = torch.where(out >= 1 << 31, out - (1 << 32), out)     # the uint32 bit pattern as int32
    return out.to(torch.int32).reshape(lead + (-1,))
