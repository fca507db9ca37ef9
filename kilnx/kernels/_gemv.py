"""The frame the one-pass GEMVs share (qmatmul.qmv, qmv_h2.qmv_h2, qmatmul_fp4.fp4_qmv).

Each program owns BLOCK_N weight rows and one of SPLIT_K ranges of packed words; it walks its range
in chunks of whole quantization groups, decodes a chunk once and uses it for every activation row,
and keeps one fp32 accumulator per (activation row, weight row). The kernels differ only in how a
chunk is decoded and multiplied; these helpers are the rest.
"""

from __future__ import annotations

import kilnx.dsl as kd


def chunk_of(BLOCK_KW: int, WPG: int) -> tuple[int, int]:
    """(groups per chunk, words per chunk): a chunk is whole groups, at least one."""
    G = max(BLOCK_KW // WPG, 1)
    return G, G * WPG


def split_range(N, KW, BLOCK_N: int, CHUNK: int, SPLIT_K: int):
    """This program's weight rows n and its word range [w_start, w_stop). Splits are whole chunks, so
    a chunk never crosses into the next split's words."""
    pid_n, pid_k = kd.grid(kd.cdiv(N, BLOCK_N), SPLIT_K)
    n = pid_n * BLOCK_N + kd.arange(0, BLOCK_N)
    words_per_split = kd.cdiv(kd.cdiv(KW, SPLIT_K), CHUNK) * CHUNK
    w_start = pid_k * words_per_split
    return n, w_start, kd.minimum(w_start + words_per_split, KW)


def activation_rows(M, BLOCK_M: int):
    """The loop over activation rows: one row needs no loop at all."""
    return kd.static_range(1) if BLOCK_M == 1 else kd.range(0, M)


def x_tile(planes, m, plane: int, wc, n, K_IN: bool):
    """x for one code position as a (BLOCK_N, CHUNK) tile (rows repeat the same addresses): it arrives
    in the packed words' register layout; a 1-d load would be re-laid out through shared memory, with
    a barrier, for every code position."""
    return kd.load(planes, m, plane, wc[None, :] + n[:, None] * 0, check=(False, False, not K_IN))


def per_group(qx, BLOCK_N: int, G: int, WPG: int):
    """(BLOCK_N, CHUNK) per-word partial sums -> (BLOCK_N, G) per-group sums."""
    return kd.reshape(kd.sum(kd.reshape(qx, (BLOCK_N * G, WPG)), axis=1), (BLOCK_N, G))


def into_row(row, m, BLOCK_M: int):
    """`row` (BLOCK_N,) placed at activation row m of a (BLOCK_M, BLOCK_N) tile, for `acc += ...`
    (the accumulator must be updated in place to carry across the loop)."""
    if BLOCK_M == 1:
        return row[None, :]
    return kd.where(kd.arange(0, BLOCK_M)[:, None] == m, row[None, :], 0.0)


def store_rows(acc, n, M, N, dtype, SPLIT_K: int):
    """The (M, N) output: stored in `dtype`, or added into a zeroed fp32 output across splits."""
    rows = kd.arange(0, acc.shape[0])
    if SPLIT_K == 1:
        out = kd.output((M, N), dtype)
        kd.store(out, rows[:, None], n[None, :], acc)
    else:
        out = kd.output((M, N), kd.f32, zero=True)
        kd.atomic_add(out, rows[:, None], n[None, :], acc)
    return out
