"""The few-row quantized GEMV on tensor cores: one decode of the weight serves up to 16 activation rows.

Why: the packed-fp16 GEMV (qmv_h2) repeats its dot per activation row (four HFMA2s and conversions
per word per row) while only the decode is shared, so on the H200 its time grew 2-3.8x from M=1 to
M=8 (bench/results/2026-12-02_h200_qmv_h2_stages_s4.csv). Here a program decodes a (BLOCK_N, GROUP)
weight tile once per quantization group into 16-bit floats and multiplies it with the (BLOCK_M, GROUP)
x tile on the tensor cores, so rows 2..16 cost almost nothing over row 1.

- decode: code q placed in the mantissa of a float magic number is `OFFSET + q` exactly, with no int
  -> float conversion: for bf16 activations OFFSET = 128 (fp32 bits 0x43000000, q at bit 16: the low
  16 bits stay zero, so the cast to bf16 is exact), for fp16 OFFSET = 1024 (fp32 0x44800000, q at
  bit 13). 8-bit codes against bf16 (no bf16 range holds 256 consecutive integers) take OFFSET 2^23
  and subtract it in fp32 first (exact); the tile is then cast to the activations' dtype.
- dot: per group, d = x_g @ (OFFSET + q_g)^T in fp32 on the tensor cores; the epilogue applies scale
  and bias with the offset folded into the bias: y += s_g * d + (b_g - OFFSET * s_g) * sum(x_g).
  Activations enter the dot as they are (bf16 or fp16): no prep kernel, no per-group rescaling.
- SWAP puts the weight tile on the dot's left (out^T = W x^T): its BLOCK_N rows fill the MMA's wide
  dimension and x's few rows its narrow one.

Errors: the products are exact in fp32 and accumulated in fp32; the folded offset costs a few fp32
ulps of OFFSET * sum|x_g| per group, far inside the bf16 rounding of the output.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd
from kilnx.kernels import _gemv as gemv
from kilnx.kernels.qmatmul import _dense_peer, _format_of, _matmul_tolerance, _qmm_spec, _qmv_key, make_qmatmul_args
from kilnx.kernels.sizes import pow2_at_least, pow2_dividing

MAX_ROWS = 64                       # a (BLOCK_M <= 64, GROUP) x tile per group: past that qmm's tiles win
DTYPES_SERVED = (torch.bfloat16, torch.float16)


def _magic(bits: int, dtype: str):
    """(fp32 bits of OFFSET, bit position of the code, OFFSET, subtract in fp32 first)."""
    if dtype == "bf16" and bits <= 7:
        return 0x43000000, 16, 128.0, False
    if dtype == "f16" and bits <= 10:
        return 0x44800000, 13, 1024.0, False
    return 0x4B000000, 0, 8388608.0, True


def decoded_tile(words, BITS: int, dtype: str):
    """(BLOCK_N, CW) packed words -> (BLOCK_N, CW * 32/BITS) codes + OFFSET in `dtype`, in element order
    (code j of word w is element w * PER + j), and OFFSET."""
    PER = 32 // BITS
    magic, at, offset, subtract = _magic(BITS, dtype)
    n, cw = words.shape
    shifts = kd.arange(0, PER) * BITS
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)   # arithmetic >>, then masked
    if at:
        codes = codes << at
    v = (codes | magic).bitcast(kd.f32)
    if subtract:
        v = v - offset
        offset = 0.0
    return kd.reshape(v, (n, cw * PER)).to(dtype), offset


def _default(x, wq, scales, biases, **_):
    """The best of 13 configs on every llama-3.1-8b shape at M = 1, 4 and 8 on the H200 (bench/results/
    2026-12-03_h200_quant_s5.csv): 64 weight rows, K split in 4, 4 warps, 4 stages, weight on the left."""
    if not x.is_cuda:
        return {}
    return {"BLOCK_N": 64, "SPLIT_K": 4, "num_warps": 4, "STAGES": 4, "SWAP": True}


@kd.kernel(
    tune={"BLOCK_N": kd.pow2(16, 256, default=64), "SPLIT_K": kd.choice(1, 2, 4, 8, default=1),
          "num_warps": kd.choice(1, 2, 4, 8, default=4), "STAGES": kd.choice(1, 2, 3, 4, 6, default=3),
          "SWAP": kd.boolean(default=True)},
    key=_qmv_key, spec=_qmm_spec, default=_default,
    specialize=lambda x, wq, s, b: {**_format_of(x, wq, s, b), "BLOCK_M": max(16, pow2_at_least(x.shape[0])),
                                    "N_DIV": pow2_dividing(wq.shape[0]), "KW_DIV": pow2_dividing(wq.shape[1])})
def qmv_tc(x, wq, scales, biases, *, BITS: kd.constexpr, GROUP: kd.constexpr, BLOCK_M: kd.constexpr,
           N_DIV: kd.constexpr, KW_DIV: kd.constexpr, BLOCK_N, SPLIT_K, STAGES, SWAP):
    """x (M <= 64, K) bf16/fp16 @ dequantize(w).T -> (M, N) in x's dtype (fp32 with split-K)."""
    M = x.shape[0]
    N, KW = wq.shape
    PER = 32 // BITS
    # one quantization group per step: the dot's result is scaled per group
    f = gemv.Frame(N, KW, WPG=GROUP // PER, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_KW=GROUP // PER,
                   SPLIT_K=SPLIT_K, N_DIV=N_DIV, KW_DIV=KW_DIV, STAGES=STAGES)
    rm = kd.arange(0, BLOCK_M)
    acc = kd.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), kd.f32)
    for w0 in f.chunks():
        wc, g, words = f.chunk(wq, w0)
        k = w0 * PER + kd.arange(0, GROUP)
        xt = kd.load(x, rm[:, None], k[None, :], check=(True, not f.K_IN))
        s = kd.reshape(f.per_weight_row(scales, g).f32(), (BLOCK_N,))
        b = kd.reshape(f.per_weight_row(biases, g).f32(), (BLOCK_N,))
        w, offset = decoded_tile(words, BITS, x.dtype)
        xsum = kd.sum(xt.f32(), axis=1)
        bias = b - offset * s if offset else b
        if SWAP:
            acc += kd.dot(w, kd.trans(xt)) * s[:, None] + bias[:, None] * xsum[None, :]
        else:
            acc += kd.dot(xt, kd.trans(w)) * s[None, :] + xsum[:, None] * bias[None, :]
    return f.store(kd.trans(acc) if SWAP else acc, M, N, x.dtype, SPLIT_K)


def serves(x, wq, scales, biases) -> bool:
    """16-bit activations, at most MAX_ROWS rows, and whole codes per word (2, 4, 8 bits)."""
    return (x.dtype in DTYPES_SERVED and x.shape[0] <= MAX_ROWS
            and 32 % _format_of(x, wq, scales, biases)["BITS"] == 0)


def run_qmv_tc(x, wq, scales, biases, *, backend=None, config=None):
    """x (M, K) -> (M, N) in x's dtype."""
    if not serves(x, wq, scales, biases):
        raise ValueError(f"qmv_tc serves bf16/fp16 x with at most {MAX_ROWS} rows and 2/4/8-bit codes; got "
                         f"{x.dtype}, {x.shape[0]} rows, {_format_of(x, wq, scales, biases)['BITS']}-bit")
    y = qmv_tc(x, wq, scales, biases, backend=backend, config=config)
    return y if y.dtype == x.dtype else y.to(x.dtype)


qmv_tc.tuning(make_args=make_qmatmul_args, peer=_dense_peer,
              problems=[{"M": m, "N": 4096, "K": 4096, "bits": 4, "gs": 64} for m in (4, 8)])
qmv_tc.tolerance = _matmul_tolerance
qmv_tc.seed_configs = lambda problem: [
    {"BLOCK_N": bn, "SPLIT_K": sk, "num_warps": nw, "STAGES": st, "SWAP": sw}
    for bn, sk, nw, st, sw in [(64, 1, 4, 3, True), (128, 1, 4, 4, True), (64, 2, 4, 4, True), (32, 1, 2, 4, False),
                               (128, 1, 8, 3, True), (64, 1, 4, 6, True), (16, 2, 1, 4, False), (256, 1, 8, 3, True)]]
