"""The CPU GEMV: affine 2/4/8-bit weights repacked once so that vector lanes run along weight rows.

Why: `qmatmul.qmv` lays x out in planes so the GPU's lanes run along the packed words; its numba
lowering vectorizes the word loop well (~34 AVX-512 instructions per 128 codes) but then needs the
per-group sums of adjacent lanes, which on the CPU are shuffles, gathers of scales and a masked tail:
in SmolLM2-135M's decode (2 EPYC cores) the qmv calls reached 5-12 GMAC/s and took ~22 of a ~38 ms step.

Here the weight is repacked at first use into interleaved blocks: `wq_il[b, w, l]` is word w of weight
row b*IL + l (IL = 16 rows, one 512-bit vector of fp32), with scales and biases as `[b, g, l]`. A
program owns R such blocks; for each quantization group it loads the group's words as (R, IL) tiles,
and every code becomes one and + one int->float convert + one fma against a scalar x broadcast to all
lanes. Scale and bias apply once per group as two more fmas; no reduction crosses lanes. x is read in
its own layout (no prep kernel, no prep launch): each program forms the group sums of x itself. With
more than 4 activation rows a program serves 8 (5-8 rows) or 16 of them (`block_m`), each decoded code
multiplied into every row: SmolLM2-135M's first token after 16 / 32 prompt tokens took 124-127 / 185-220 ms against
162-169 / 273-276 with a program per row (2 EPYC cores, alternated runs; 4 tokens and decode unchanged).

- Codes are decoded without a shift: `word & (MASK << s)` converts to code * 2^s exactly, and x is
  pre-multiplied by 2^-s (a scalar, exact: a power of two). The top code of a word would be negative
  as an i32, so it is shifted down as usual.
- Per group, the terms are summed in one chain per word (PER fmas) and the chains then added: with a
  single chain over the group the fma latency, not throughput, would set the pace.

qmatmul's route (kernels/routing.py) takes it for CPU activations with up to 32 rows by default (decode
and short prompts); longer prefill chunks take the tile GEMM. The repacked copy is made once per weight
and kept while the weight lives.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd
from kilnx.dsl.kernel import PerObjectMemo
from kilnx.kernels.qmatmul import _dense_spec, _matmul_tolerance, make_qmatmul_args
from kilnx.kernels.sizes import pow2_dividing

IL = 16          # weight rows per interleaved block: one AVX-512 register of fp32 (two AVX2 ones)


def block_m(rows: int) -> int:
    """Activation rows per program (each decoded code serves them all): 8 for 5-8 rows, 16 from 9, else 1 (a
    program per row; 4 rows per program measured no faster than that, 4 tokens). A multi-row size is a numba
    compilation of ~10-18 s per weight format on a cold cache (the one-row kernel: ~2 s); the 8-row one is
    for batched decode (a server's 5-8 sequences), where 16 rows a program cost as much at 5 rows as at 16."""
    return 1 if rows <= 4 else 8 if rows <= 8 else 16


def interleave(wq: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, il: int = IL):
    """(N, KW) words and (N, G) scales/biases -> (ceil(N/il), KW, il) and (ceil(N/il), G, il); rows past N
    are zero (their outputs are not stored)."""
    n = wq.shape[0]
    pad = -n % il

    def blocks(t):
        if pad:
            t = torch.cat([t, t.new_zeros(pad, t.shape[1])])
        return t.reshape(-1, il, t.shape[1]).transpose(1, 2).contiguous()
    return blocks(wq), blocks(scales), blocks(biases)


def _format(x, wq, scales, biases):
    k = x.shape[1]
    bits = wq.shape[1] * 32 // k
    return {"BITS": bits, "GROUP": k // scales.shape[1]}


def _key(x, wq, scales, biases, **_):
    f = _format(x, wq, scales, biases)
    return {"M": x.shape[0], "N": wq.shape[0] * wq.shape[2], "K": x.shape[1], "bits": f["BITS"], "gs": f["GROUP"]}


def _plain(wq, scales, biases):
    """The interleaved weight back in (N padded, KW) / (N padded, G) rows."""
    return tuple(t.transpose(1, 2).reshape(-1, t.shape[1]) for t in (wq, scales, biases))


def _spec(x, wq, scales, biases, *, BITS, GROUP, **_):
    return _dense_spec(x, *_plain(wq, scales, biases), BITS, GROUP)


def _tree_sum(terms):
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


@kd.kernel(tune={"R": kd.pow2(1, 8, default=4), "num_warps": kd.choice(1, 2, 4, default=4)},
           key=_key, spec=_spec,
           specialize=lambda x, wq, s, b: {**_format(x, wq, s, b), "NB_DIV": pow2_dividing(wq.shape[0]),
                                           "BLOCK_M": block_m(x.shape[0])})
def qmv_il(x, wq, scales, biases, *, BITS: kd.constexpr, GROUP: kd.constexpr,
           NB_DIV: kd.constexpr, BLOCK_M: kd.constexpr, R):
    """x (M, K) @ W.T -> (M, NB * IL) in x.dtype (padded rows give 0), W interleaved (see `interleave`).
    A program serves BLOCK_M activation rows: each code is decoded once and multiplied into every row."""
    M, K = x.shape
    NB = wq.shape[0]
    PER = 32 // BITS                 # codes per word
    WPG = GROUP // PER               # words per group
    MASK = (1 << BITS) - 1
    B_IN = NB_DIV % R == 0           # whole block ranges: no bounds checks on the block index
    pm, pb = kd.grid(kd.cdiv(M, BLOCK_M), kd.cdiv(NB, R))
    blk = (pb * R + kd.arange(0, R))[:, None]        # (R, 1)
    lane = kd.arange(0, IL)[None, :]                 # (1, IL)
    chk = (not B_IN, False, False)
    if BLOCK_M == 1:
        m = pm
        shape, xrow = (R, IL), lambda v: v
    else:
        m = pm * BLOCK_M + kd.arange(0, BLOCK_M)     # (BLOCK_M,) rows; past M: x reads 0, nothing stored
        shape, xrow = (BLOCK_M, R, IL), lambda v: v[:, None, None]
    acc = kd.zeros(shape, kd.f32)
    for g in kd.range(0, K // GROUP):
        chains, xs = [], []
        for wi in kd.static_range(WPG):
            w = g * WPG + wi
            words = kd.load(wq, blk, w, lane, check=chk)
            chain = None
            for j in kd.static_range(PER):
                xv = kd.load(x, m, w * PER + j, check=(BLOCK_M > 1, False)).f32()
                xs.append(xv)
                if j == PER - 1:    # the top code: as a masked i32 it would be negative
                    t = ((words >> (j * BITS)) & MASK).f32() * xrow(xv)
                else:               # code * 2^(j*BITS), exactly; x carries the 2^-(j*BITS)
                    t = (words & (MASK << (j * BITS))).f32() * xrow(xv * (2.0 ** (-j * BITS)))
                chain = t if chain is None else chain + t
            chains.append(chain)
        dot = _tree_sum(chains)
        s = kd.load(scales, blk, g, lane, check=chk).f32()
        b = kd.load(biases, blk, g, lane, check=chk).f32()
        acc += dot * s + b * xrow(_tree_sum(xs))
    out = kd.output((M, NB * IL), x.dtype)
    if BLOCK_M == 1:
        kd.store(out, m, blk * IL + lane, acc, check=(False, not B_IN))
    else:
        kd.store(out, m[:, None, None], (blk * IL + lane)[None, :, :], acc, check=(True, not B_IN))
    return out


_IL = PerObjectMemo()
"""packed weight -> its interleaved (wq, scales, biases)."""


def run_qmv_il(x, wq, scales, biases, *, backend=None, config=None):
    """x (M, K) @ W.T -> (M, N) for a packed (N, KW) weight, repacked on first use and kept while it lives."""
    il = _IL.get((wq, scales, biases), None)
    if il is PerObjectMemo.MISSING:
        il = _IL.put((wq, scales, biases), None, interleave(wq, scales, biases))
    y = qmv_il(x, *il, backend=backend, config=config)
    return y if y.shape[1] == wq.shape[0] else y[:, :wq.shape[0]]


def make_args(problem: dict, device: str):
    x, wq, s, b = make_qmatmul_args(problem, device)
    return (x, *interleave(wq, s, b))


qmv_il.tuning(make_args=make_args, problems=[{"M": 1, "N": 3072, "K": 576, "bits": 4, "gs": 32}])
qmv_il.tolerance = lambda args: _matmul_tolerance((args[0], *_plain(*args[1:])))
