"""The 4- and 8-bit GEMV in packed fp16 arithmetic: two codes per instruction.

Why: the fp32 GEMV (`qmatmul.qmv`) issues ~5.5 instructions per 4-bit code in its sm_90 SASS (decode,
offset fma, product fma, reductions), about as many as the H200's SMs can issue per code at 4 TB/s
(~5); it reached 40% of the copy ceiling. Here a code pair costs about one instruction each for its
decode and its product (3.2-3.5 per code in all, in the same SASS count):

- decode: `(word & 0x000F000F) | 0x64006400` is the fp16 pair (1024 + q_0, 1024 + q_4); one HFMA2
  (kd.h2_fma) subtracts 1024 and gives (q_0, q_4) exactly. The mask 0x00F000F0 gives 1024 + 16 q_1,
  fixed by * 1/16 - 64 in the same instruction; `word >> 8` serves codes 2, 3, 6, 7. 8-bit codes use
  0x00FF00FF on the word and on `word >> 8`. Pair p holds codes (p, p + PER/2).
- dot: the prep kernel stores x as fp16 pairs in the same order (`planes[m, p, w]` = x[w*PER + p]
  with x[w*PER + p + PER/2]), so a word's partial dot is PER/2 HFMA2s, widened to fp32 once.
- range: each quantization group of x is divided by a power of two above its largest magnitude
  (exact), so |x'| < 1 in fp16 and a word's fp16 partial sum stays below 8 * 255; the group's fp32
  result is multiplied back: y = sum_g s_g * xs_g * dot_g + b_g * sum_g(x).

The error is that of fp16 products and 4-term fp16 sums (relative 2^-11 of a word's partial), well
inside the bf16 rounding of the output. Scales and biases are applied in fp32 as in `qmv`.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd
from kilnx.kernels import _gemv as gemv
from kilnx.kernels.qmatmul import _dense_peer, _dense_spec, _format_of, _matmul_tolerance, make_qmatmul_args
from kilnx.kernels.sizes import pow2_at_least, pow2_dividing

MAGIC = 0x64006400            # fp16 1024.0 in both halves
ONE, NEG_1024 = 0x3C003C00, 0xE400E400
SIXTEENTH, NEG_64 = 0x2C002C00, 0xD400D400
BITS_SERVED = (4, 8)


# pair p of a word: (shift, mask); the masks with 16x codes (0x00F000F0) are fixed by * 1/16 - 64
PAIRS = {4: [(0, 0x000F000F), (0, 0x00F000F0), (8, 0x000F000F), (8, 0x00F000F0)],
         8: [(0, 0x00FF00FF), (8, 0x00FF00FF)]}


def _exact_pair(words, bits: int, p: int):
    """Pair p of each word (codes p and p + PER/2) as exact fp16 halves: one LOP3 and one HFMA2.

    (src | MAGIC) & (mask | MAGIC) is (src & mask) | MAGIC (the magic bits lie outside every mask),
    written so that each instruction needs one constant: the OR is shared by the pairs of one source,
    and no mask has to be moved into a register first."""
    shift, mask = PAIRS[bits][p]
    src = words >> shift if shift else words        # arithmetic >>: the sign bits land above every mask
    h = ((src | MAGIC) & (mask | MAGIC)).bitcast(kd.u32)
    return kd.h2_fma(h, SIXTEENTH, NEG_64) if mask == 0x00F000F0 else kd.h2_fma(h, ONE, NEG_1024)


def _exact_pairs(words, bits: int):
    """The PER/2 code pairs of each word as exact fp16 halves (pair p = codes p and p + PER/2)."""
    return [_exact_pair(words, bits, p) for p in range(len(PAIRS[bits]))]


def _group_scale(amax, bias: int = 0):
    """(xs, 1/xs): the power of two just above each group's largest |x| divided by 2^bias, and its
    inverse, by exponent arithmetic (exact), so |x / xs| < 2^bias. A group of zeros (or of values
    below 2^(bias-126)) gets 2^(-126) as if its largest were there."""
    e = (amax.bitcast(kd.i32) >> 23) & 0xFF
    e = kd.minimum(kd.maximum(e, bias), 253) if bias else kd.minimum(e, 253)
    return ((e + (1 - bias)) << 23).bitcast(kd.f32), (((253 + bias) - e) << 23).bitcast(kd.f32)


def _pairs_of(x, per):
    """torch meaning of the prep (before scaling): (M, PER/2, KW, 2) floats, pair p of word w."""
    m, k = x.shape
    v = x.float().reshape(m, k // per, 2, per // 2)           # [w, half, p]: half 0 = codes p, 1 = p+PER/2
    return v.permute(0, 3, 1, 2)


def _prep_spec(x, *, PER, GROUP, BIAS=0, **_):
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)
    amax = g.abs().amax(-1)
    e = torch.clamp((amax.view(torch.int32) >> 23) & 0xFF, min=BIAS, max=253)
    xs = ((e + 1 - BIAS) << 23).view(torch.float32)
    scaled = (g / xs[..., None]).reshape(m, k)
    h = _pairs_of(scaled, PER).to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    planes = (h[..., 0] | (h[..., 1] << 16)).contiguous().view(torch.uint32)
    return planes, g.sum(-1), xs


def _prepared_tiles(lo, hi, *, PER: int, GROUP: int, BIAS: int = 0):
    """(packed pairs, group sums, group scales xs) of fp32 tiles lo/hi (..., W, PER/2) = x[w*PER + p] and
    x[w*PER + p + PER/2] of W words in whole groups: the fp16 pairs scaled per group by the power of two
    of _group_scale; sums and xs (..., W*PER/GROUP)."""
    *lead, W, HALF = lo.shape
    lead, WPG = tuple(lead), GROUP // PER                  # words per group
    NG = W // WPG
    new_axis = (slice(None),) * (len(lead) + 1) + (None,)  # x[..., None] for a (*lead, n) tile
    lo_g, hi_g = kd.reshape(lo, (*lead, NG, WPG * HALF)), kd.reshape(hi, (*lead, NG, WPG * HALF))
    xs, inv = _group_scale(kd.maximum(kd.max(kd.abs(lo_g), axis=-1), kd.max(kd.abs(hi_g), axis=-1)), BIAS)
    inv_w = kd.reshape(kd.broadcast_to(inv[new_axis], (*lead, NG, WPG)), (*lead, W))[new_axis]
    return kd.h2_pack(lo * inv_w, hi * inv_w), kd.sum(lo_g, axis=-1) + kd.sum(hi_g, axis=-1), xs


def store_prepared(lo, hi, row, w0, w, M, K, *, PER: int, GROUP: int, BIAS: int = 0):
    """Store x in qmv_h2's input form, from fp32 tiles lo/hi (BW, PER/2) = x[w*PER + p] and
    x[w*PER + p + PER/2] of words w = w0 + arange(BW) (whole groups: w0 and BW multiples of GROUP/PER):
    the packed fp16 planes scaled per group by a power of two, the group sums and the group scales.
    Shared by qmv_h2_prep and the producers that emit prepared activations directly (kernels/prepared.py)."""
    return store_prepared_into(prepared_outputs(M, K, PER=PER, GROUP=GROUP), lo, hi, row, w0, w, PER=PER,
                               GROUP=GROUP, BIAS=BIAS)


def prepared_outputs(M, K, *, PER: int, GROUP: int):
    """The kernel's outputs (planes, group sums, group scales) for prepared x (M, K)."""
    return (kd.output((M, PER // 2, K // PER), kd.u32, name="planes"),
            kd.output((M, K // GROUP), kd.f32, name="group_sums"),
            kd.output((M, K // GROUP), kd.f32, name="group_scales"))


def store_prepared_into(outputs, lo, hi, row, w0, w, *, PER: int, GROUP: int, BIAS: int = 0):
    """store_prepared into prepared_outputs made once (a kernel that stores several rows in a loop)."""
    planes, sums, scale = outputs
    packed, group_sums, xs = _prepared_tiles(lo, hi, PER=PER, GROUP=GROUP, BIAS=BIAS)
    kd.store(planes, row, kd.arange(0, PER // 2)[:, None], w[None, :], kd.trans(packed))
    g = w0 // (GROUP // PER) + kd.arange(0, xs.shape[0])
    kd.store(sums, row, g, group_sums)
    kd.store(scale, row, g, xs)
    return planes, sums, scale


def prepare_stored(x, outputs, row, w0, n_words: int, *, PER: int, GROUP: int):
    """Words w0 .. w0 + n_words (whole groups) of row `row` of x, which this program has just stored, read back in
    the prep's order and stored prepared into prepared_outputs: for kernels whose tile holds its values in another
    order (kernels/swiglu_prep.py). The barrier lets every thread read what the others stored
    (without it, a program read values not yet stored, on the H100)."""
    kd.barrier()
    w = w0 + kd.arange(0, n_words)
    lo_i, hi_i = code_pairs_index(w, PER)
    lo, hi = kd.load(x, row, lo_i, check=False).f32(), kd.load(x, row, hi_i, check=False).f32()
    return store_prepared_into(outputs, lo, hi, row, w0, w, PER=PER, GROUP=GROUP)


def code_pairs_index(w, PER: int):
    """(lo, hi) element indices of words w: (BW, PER/2) tiles of x[w*PER + p], x[w*PER + p + PER/2]."""
    p = kd.arange(0, PER // 2)
    lo = w[:, None] * PER + p[None, :]
    return lo, lo + PER // 2


@kd.kernel(tune={"BLOCK_KW": kd.pow2(16, 512, default=128), "num_warps": kd.choice(1, 2, 4, default=4)},
           key=lambda x, **kw: {"M": x.shape[0], "K": x.shape[1]}, spec=_prep_spec)
def qmv_h2_prep(x, *, PER: kd.constexpr, GROUP: kd.constexpr, BIAS: kd.constexpr = 0, BLOCK_KW):
    """x (M, K) -> (planes, group sums, group scales xs): |planes| < 2^BIAS (see _group_scale)."""
    M, K = x.shape
    BW = max(BLOCK_KW, GROUP // PER)      # whole groups per program
    row, pw = kd.grid(M, kd.cdiv(kd.cdiv(K, PER), BW))
    w = pw * BW + kd.arange(0, BW)
    lo_i, hi_i = code_pairs_index(w, PER)
    return store_prepared(kd.load(x, row, lo_i).f32(), kd.load(x, row, hi_i).f32(), row, pw * BW, w, M, K,
                          PER=PER, GROUP=GROUP, BIAS=BIAS)


def _x_of(planes, xs):
    """x back from the prepared planes (exact: the fp16 values times their group's power of two)."""
    m, half, kw = planes.shape
    u = planes.view(torch.int32)
    lo = (u & 0xFFFF).to(torch.int16).view(torch.float16).float()
    hi = ((u >> 16) & 0xFFFF).to(torch.int16).view(torch.float16).float()
    v = torch.stack([lo, hi], dim=-1).permute(0, 2, 3, 1).reshape(m, kw * 2 * half)
    return (v.reshape(m, xs.shape[1], -1) * xs[..., None]).reshape(m, -1)


def _format(planes, sums, xs, wq, scales, biases):
    per = 2 * planes.shape[1]
    return {"BITS": 32 // per, "GROUP": per * planes.shape[2] // scales.shape[1]}


def _key(planes, sums, xs, wq, scales, biases, **_):
    f = _format(planes, sums, xs, wq, scales, biases)
    return {"M": planes.shape[0], "N": wq.shape[0], "K": 2 * planes.shape[1] * planes.shape[2],
            "bits": f["BITS"], "gs": f["GROUP"]}


def _spec(planes, sums, xs, wq, scales, biases, *, BITS, GROUP, **_):
    return _dense_spec(_x_of(planes, xs), wq, scales, biases, BITS, GROUP, dtype=scales.dtype)


def _default(planes, sums, xs, wq, scales, biases, **_):
    """Untuned starting points by activation rows, each the config with the best geomean over the four
    llama-3.1-8b shapes in a sweep of 40 on the H200 (bench/results/2026-12-02_h200_qmv_h2_stages_s4.csv):
    within 4% (1 row), 11% (2-4) and 8% (5-8) of each shape's best. All pipeline the chunk loop 3 deep.
    Two words per fp16 accumulator (CHAIN 2) and, at one row, 4 x 256-word tiles for K >= 8192: down
    15.2 us against 16.5 with the 8 x 128 tile (bench/results/2026-12-03_h200_quant_s10_chain.csv,
    where gate_up, qkv and o were within 1-3% across CHAIN 1, 2, 4 and down 4-6% faster with 2 or 4; the
    rule first went by words per row, which took 8-bit gate_up to the long tile: 80.3% of copy, not 85.7).
    Off the GPU: the space's defaults (the CPU routes its rows to qmatmul.qmv)."""
    if not planes.is_cuda:
        return {}
    rows = planes.shape[0]
    if rows == 1 and 2 * planes.shape[1] * planes.shape[2] >= 8192:     # long rows (llama's down)
        return {"BLOCK_N": 4, "BLOCK_KW": 256, "num_warps": 2, "STAGES": 3, "CHAIN": 2}
    if rows == 1:
        return {"BLOCK_N": 8, "BLOCK_KW": 128, "num_warps": 2, "STAGES": 3, "CHAIN": 2}
    # several rows (per-group accumulators per row since session 14; a sweep of 7 configs over the four
    # shapes at 4 and 8 rows, bench/results/2026-12-04_h200_quant_s14_qmv_rows.csv): 4 words per fp16
    # accumulator and 8 x 128-word tiles, but for the wide gate_up (16 x 128 at 2-4 rows) and, at 5-8 rows,
    # 8 x 64 tiles with one warp where N >= 6144 and K is short (qkv 22.7 us against 24.1; gate_up 77.8
    # against 92.2); down at 8 rows took 42.3 us on the 8 x 128 tile against 67.7 on the old default.
    n, k = wq.shape[0], 2 * planes.shape[1] * planes.shape[2]
    if rows <= 4:
        if n >= 16384:
            return {"BLOCK_N": 16, "BLOCK_KW": 128, "num_warps": 2, "STAGES": 3, "CHAIN": 2}
        return {"BLOCK_N": 8, "BLOCK_KW": 128, "num_warps": 2, "STAGES": 3, "CHAIN": 4}
    if n >= 6144 and k < 8192:
        return {"BLOCK_N": 8, "BLOCK_KW": 64, "num_warps": 1, "STAGES": 3, "CHAIN": 4}
    return {"BLOCK_N": 8, "BLOCK_KW": 128, "num_warps": 2, "STAGES": 3, "CHAIN": 4}


@kd.kernel(
    tune={"BLOCK_N": kd.pow2(1, 64, default=16), "BLOCK_KW": kd.pow2(8, 512, default=128),
          "SPLIT_K": kd.choice(1, 2, 4, 8, default=1),
          "num_warps": kd.choice(1, 2, 4, 8, default=4), "STAGES": kd.choice(1, 2, 3, 4, default=1),
          "CHAIN": kd.choice(1, 2, 4, default=1)},
    key=_key, spec=_spec, default=_default,
    specialize=lambda p, su, xs, wq, sc, b: {**_format(p, su, xs, wq, sc, b), "BLOCK_M": pow2_at_least(p.shape[0]),
                                             "N_DIV": pow2_dividing(wq.shape[0]),
                                             "KW_DIV": pow2_dividing(wq.shape[1])})
def qmv_h2(planes, sums, xs, wq, scales, biases, *, BITS: kd.constexpr, GROUP: kd.constexpr,
           BLOCK_M: kd.constexpr, N_DIV: kd.constexpr, KW_DIV: kd.constexpr,
           BLOCK_N, BLOCK_KW, SPLIT_K, STAGES, CHAIN):
    N, KW = wq.shape
    f = gemv.Frame(N, KW, WPG=GROUP * BITS // 32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_KW=BLOCK_KW,
                   SPLIT_K=SPLIT_K, N_DIV=N_DIV, KW_DIV=KW_DIV, STAGES=STAGES)
    acc = accumulate(f, planes, sums, xs, wq, scales, biases, BITS=BITS, chain=min(CHAIN, f.WPG))
    return f.store(acc, planes.shape[0], N, scales.dtype, SPLIT_K)


def accumulate(f, planes, sums, xs, wq, scales, biases, *, BITS: int, chain: int = 1):
    """The program's (BLOCK_M, BLOCK_N) fp32 results over its words: qmv_h2's main loop, shared with the
    GEMVs that finish differently (qkv_rope.qkv_rope_cache_h2). chain: see gemv.Frame.h2_group_dot."""
    PER = 32 // BITS                 # codes per word
    acc = f.group_accumulator()
    for w0 in f.chunks():
        wc, g, words = f.chunk(wq, w0)
        s, b = f.per_weight_row(scales, g).f32(), f.per_weight_row(biases, g).f32()
        # every row reuses the decoded pairs (one row decodes each pair right where it is used, so
        # only one pair tile is live at a time)
        pairs = _exact_pairs(words, BITS) if f.BLOCK_M > 1 else None
        for m in f.rows(planes.shape[0]):
            qx_g = f.h2_group_dot(lambda p: _exact_pair(words, BITS, p), pairs, planes, m, wc, PER // 2, chain)
            f.add_group_terms(acc, qx_g * s * f.per_x_row(xs, m, g)[None, :] + b * f.per_x_row(sums, m, g)[None, :], m)
    return f.group_results(acc)


def serves(x, wq, scales, biases) -> bool:
    return _format_of(x, wq, scales, biases)["BITS"] in BITS_SERVED


def run_qmv_h2(x, wq, scales, biases, *, backend=None, config=None, prep_config=None):
    """x (M, K) -> (M, N) in scales' dtype (fp32 with split-K): prep then the GEMV."""
    f = _format_of(x, wq, scales, biases)
    if f["BITS"] not in BITS_SERVED:
        raise ValueError(f"qmv_h2 serves {BITS_SERVED}-bit codes, got {f['BITS']}-bit; use qmatmul.run_qmv")
    planes, sums, xs = qmv_h2_prep(x, PER=32 // f["BITS"], GROUP=f["GROUP"], backend=backend, config=prep_config)
    return qmv_h2(planes, sums, xs, wq, scales, biases, backend=backend, config=config)


def make_qmv_h2_args(problem: dict, device: str):
    """qmv_h2's own inputs: the prepared activations (what qmv_h2_prep makes) with the packed weight."""
    x, wq, scales, biases = make_qmatmul_args(problem, device)
    f = _format_of(x, wq, scales, biases)
    planes, sums, xs = _prep_spec(x.cpu(), PER=32 // f["BITS"], GROUP=f["GROUP"])
    return planes.to(device), sums.to(device), xs.to(device), wq, scales, biases


def _dense_peer_prepared(planes, sums, xs, wq, scales, biases):
    return _dense_peer(_x_of(planes, xs).to(scales.dtype), wq, scales, biases)


def _tolerance(args):
    planes, sums, xs, wq, scales, biases = args
    return _matmul_tolerance((_x_of(planes, xs), wq, scales, biases))


qmv_h2.tuning(make_args=make_qmv_h2_args, peer=_dense_peer_prepared,
              problems=[{"M": m, "N": 4096, "K": 4096, "bits": 4, "gs": 64} for m in (1, 4)])
qmv_h2.tolerance = _tolerance
qmv_h2.seed_configs = lambda problem: [
    {"BLOCK_N": bn, "BLOCK_KW": kw, "num_warps": nw, "STAGES": ns, "SPLIT_K": 1}
    for bn, kw, nw, ns in [(8, 128, 2, 3), (16, 128, 2, 3), (8, 64, 1, 3), (8, 256, 4, 3), (16, 256, 4, 3),
                           (8, 256, 4, 1), (8, 64, 1, 1), (16, 256, 4, 1), (8, 128, 2, 4), (32, 128, 4, 3)]]
