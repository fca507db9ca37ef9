"""The frame the one-pass GEMVs share (qmatmul.qmv, qmv_h2.qmv_h2, qmatmul_fp4.fp4_qmv).

Each program owns BLOCK_N weight rows and one of SPLIT_K ranges of packed words; it walks its range
in chunks of whole quantization groups, decodes a chunk once and uses it for every activation row,
and keeps one fp32 accumulator per (activation row, weight row). The kernels differ only in how a
chunk is decoded and multiplied; `Frame` is the rest.
"""

from __future__ import annotations

import kilnx.dsl as kd


class Frame:
    """One program's share of a GEMV over an (N, KW) packed weight with WPG words per group.

    ROWS_IN / K_IN: the blocks divide N / the words (N_DIV, KW_DIV: the largest powers of two dividing
    them, specialized per call), so the loads need no bounds masks there.

    STAGES > 1 software-pipelines the chunk loop: each program keeps STAGES chunks' loads in flight
    through shared memory instead of waiting on one chunk's loads before it issues the next (an un-
    pipelined GEMV is latency-bound: ncu showed DRAM half busy at 25% occupancy on the H200).

    Measured and dropped: programs streaming several row blocks through one flattened loop (to keep their
    pipelines full across blocks and the grid in one wave) were slower on every llama-3.1-8b shape on the
    H200, 2 blocks per program by 0-40% (bench/results/2026-12-03_h200_quant_s10_blocks.csv). So was asking L2
    for the program's weights before the grid sync (kd.prefetch, while the kernel before runs under PDL;
    KILNX_GEMV_PREFETCH until session 38): the whole range lost on the H200 (llama-3.1-8b decode 392.5 / 397.5
    tok/s against 402.3 / 413.5, 2026-12-03_h200_e2e_s6_prefetch_ab*.csv), the first chunk only was even on the
    H100 (2026-12-07_h100_e2e_prefetch_arms_s36.csv) and lost 4.5% on the H200 (510.1 / 510.4 against 534.5 /
    534.3, 2026-12-07_h200_e2e_prefetch_arms_s37.csv), and so did the residual norm's prefetch of its row
    (KILNX_NORM_PREFETCH): the GEMV's blocks start only once the kernel before has passed its own wait, and DRAM
    is busy with that kernel's stream until its tail. And so did letting the next kernel in after the main loop
    (kd.launch_dependents, as the one-wave fused SwiGLU does; KILNX_GEMV_TRIGGER in session 39): llama-3.1-8b decode
    441.8 / 443.9 tok/s against 456.9 / 459.8 on the H100, llama-3.2-1b 1661.4 / 1663.4 against 1651.5 / 1657.0
    (2026-12-07_h100_e2e_trigger_arms_{8b,1b}_s39.csv)."""

    def __init__(self, N, KW, *, WPG: int, BLOCK_M: int, BLOCK_N: int, BLOCK_KW: int, SPLIT_K: int, N_DIV: int,
                 KW_DIV: int, STAGES: int = 1, rows_of=None):
        """rows_of(pid_n) -> the program's BLOCK_N weight rows, when they are not the consecutive block
        pid_n * BLOCK_N + arange(BLOCK_N) (any set that the programs cover once; ROWS_IN still says
        whether every row lies in bounds)."""
        self.N, self.WPG, self.BLOCK_M, self.BLOCK_N, self.STAGES = N, WPG, BLOCK_M, BLOCK_N, STAGES
        self.check_m = BLOCK_M > 1 and STAGES > 1    # activation rows past M are visited (see rows())
        self.G = max(BLOCK_KW // WPG, 1)            # groups per chunk
        self.CHUNK = self.G * WPG                    # words per chunk: whole groups
        self.ROWS_IN, self.K_IN = N_DIV % BLOCK_N == 0, KW_DIV % self.CHUNK == 0
        pid_n, pid_k = kd.grid(kd.cdiv(N, BLOCK_N), SPLIT_K)
        self.n = rows_of(pid_n) if rows_of is not None else pid_n * BLOCK_N + kd.arange(0, BLOCK_N)
        # splits are whole chunks, so a chunk never crosses into the next split's words
        words_per_split = kd.cdiv(kd.cdiv(KW, SPLIT_K), self.CHUNK) * self.CHUNK
        self.w_start = pid_k * words_per_split
        self.w_stop = kd.minimum(self.w_start + words_per_split, KW)

    def chunks(self):
        """The loop over this program's chunks, yielding each chunk's first word."""
        return kd.range(self.w_start, self.w_stop, self.CHUNK, stages=self.STAGES if self.STAGES > 1 else None)

    def chunk(self, wq, w0):
        """(wc, g, words): the chunk's word and group indices and its (BLOCK_N, CHUNK) packed words."""
        wc = w0 + kd.arange(0, self.CHUNK)
        g = w0 // self.WPG + kd.arange(0, self.G)
        words = kd.load(wq, self.n[:, None], wc[None, :], hint="stream", check=(not self.ROWS_IN, not self.K_IN))
        return wc, g, words

    def per_weight_row(self, t, g):
        """(BLOCK_N, G) of a per-group weight tensor (scales, biases), as loaded."""
        return kd.load(t, self.n[:, None], g[None, :], check=(not self.ROWS_IN, not self.K_IN))

    def rows(self, M):
        """The loop over activation rows. One row needs no loop; a pipelined chunk loop unrolls the rows
        (Triton pipelines only innermost loops), visiting all BLOCK_M rows with the ones past M masked."""
        if self.BLOCK_M == 1:
            return kd.static_range(1)
        return kd.static_range(self.BLOCK_M) if self.check_m else kd.range(0, M)

    def per_x_row(self, t, m, g):
        """(G,) of a per-group activation tensor (group sums, group scales) for activation row m."""
        return kd.load(t, m, g, check=(self.check_m, not self.K_IN))

    def x_tile(self, planes, m, plane: int, wc):
        """x for one code position as a (BLOCK_N, CHUNK) tile (rows repeat the same addresses): it
        arrives in the packed words' register layout; a 1-d load would be re-laid out through shared
        memory, with a barrier, for every code position. A pipelined loop stages its loads through
        shared memory anyway, so there x is loaded once, as a row, and read out in the words' layout."""
        if self.STAGES > 1:
            return kd.broadcast_to(kd.load(planes, m, plane, wc, check=(self.check_m, False, not self.K_IN))[None, :],
                                   (self.BLOCK_N, self.CHUNK))
        return kd.load(planes, m, plane, wc[None, :] + self.n[:, None] * 0, check=(self.check_m, False, not self.K_IN))

    def dot(self, values, planes, m, wc):
        """sum_j values[j] * x[word's code j], per word: (BLOCK_N, CHUNK) fp32."""
        qx = None
        for j in kd.static_range(len(values)):
            term = values[j] * self.x_tile(planes, m, j, wc)
            qx = term if qx is None else qx + term
        return qx

    def h2_group_dot(self, pair, pairs, planes, m, wc, n_pairs: int, chain: int = 1):
        """Per-group fp32 sums (BLOCK_N, G) of code * x for activation row m, two codes per HFMA2:
        code pair p is pairs[p] (decoded once for every row) or pair(p) (decoded where it is used, so
        one row keeps one pair tile live); planes hold x as fp16 pairs in the same order.

        chain: consecutive words whose products one fp16 accumulator chains before it is widened to
        fp32. Widening and adding costs three instructions per accumulator (of ~27 that a 4-bit word costs
        in all in sm_90 SASS); chaining 2 words halves that, at fp16 rounding over 2 * n_pairs products
        instead of n_pairs (tests/kernels/test_qmv_h2.py holds the error of CHAIN 2 and 4 on a llama-sized
        row below bf16's own rounding of the output). On the H200 it shortened down and the 8-bit GEMV by
        ~5% and left gate_up as it was."""
        d = None
        for p in kd.static_range(n_pairs):
            code = pairs[p] if pairs is not None else pair(p)
            d = h2_chain_fma(code, self.x_tile(planes, m, p, wc), d, chain)
        return self.per_group(kd.h2_sum(d), words_per_value=chain)          # fp32 from here

    def per_group(self, qx, words_per_value: int = 1):
        """(BLOCK_N, CHUNK / words_per_value) partial sums, each over words_per_value consecutive words ->
        (BLOCK_N, G) per-group sums."""
        per = self.WPG // words_per_value
        return kd.reshape(kd.sum(kd.reshape(qx, (self.BLOCK_N * self.G, per)), axis=1), (self.BLOCK_N, self.G))

    def group_accumulator(self):
        """The accumulator of the h2 GEMVs' per-group terms: for one activation row a (BLOCK_N, G) tile,
        summed over the groups once, after the loop (summing each chunk's costs a lane reduction and two
        layout conversions through shared memory, with their barriers, per chunk); for more rows one such
        tile per row, (BLOCK_M, BLOCK_N, G), each chunk's terms added at their row (the per-chunk reduction
        they replaced cost ~60 SASS instructions per row and chunk on sm_90)."""
        return kd.zeros((self.BLOCK_N, self.G) if self.BLOCK_M == 1 else (self.BLOCK_M, self.BLOCK_N, self.G), kd.f32)

    def add_group_terms(self, acc, terms, m):
        """acc += activation row m's (BLOCK_N, G) per-group terms of one chunk."""
        if self.BLOCK_M == 1:
            acc += terms
        else:
            acc += kd.where(kd.arange(0, self.BLOCK_M)[:, None, None] == m, terms[None, :, :], 0.0)

    def group_results(self, acc):
        """The (BLOCK_M, BLOCK_N) fp32 results of a group_accumulator after the loop."""
        return kd.sum(acc, axis=1)[None, :] if self.BLOCK_M == 1 else kd.sum(acc, axis=2)

    def store(self, acc, M, N, dtype, SPLIT_K: int):
        """The (M, N) output: stored in `dtype`, or added into a zeroed fp32 output across splits."""
        rows = kd.arange(0, acc.shape[0])
        if SPLIT_K == 1:
            out = kd.output((M, N), dtype)
            kd.store(out, rows[:, None], self.n[None, :], acc)
        else:
            out = kd.output((M, N), kd.f32, zero=True)
            kd.atomic_add(out, rows[:, None], self.n[None, :], acc)
        return out


def h2_chain_fma(code, xp, d, chain: int):
    """d + code * xp in packed fp16 (d None: no accumulator yet), the (..., CHUNK) tiles' products of
    `chain` consecutive words summed into each accumulator lane: a (..., CHUNK / chain) result."""
    for j in kd.static_range(chain):
        c, x = (word_slice(code, chain, j), word_slice(xp, chain, j)) if chain > 1 else (code, xp)
        d = kd.h2_fma(c, x, 0) if d is None else kd.h2_fma(c, x, d)
    return d


def word_slice(t, chain: int, j: int):
    """Words j, j + chain, j + 2 chain, ... along the last axis of a (..., CHUNK) tile: (..., CHUNK / chain)."""
    *lead, chunk = t.shape
    return kd.pick(kd.reshape(t, (*lead, chunk // chain, chain)), j, axis=-1)


def into_row(row, m, BLOCK_M: int):
    """`row` (BLOCK_N,) placed at activation row m of a (BLOCK_M, BLOCK_N) tile, for `acc += ...`
    (the accumulator must be updated in place to carry across the loop)."""
    if BLOCK_M == 1:
        return row[None, :]
    return kd.where(kd.arange(0, BLOCK_M)[:, None] == m, row[None, :], 0.0)
