"""The fp4 (mxfp4 / nvfp4) GEMV in packed fp16 arithmetic: two e2m1 codes per instruction.

Why: `qmatmul_fp4.fp4_qmv` decodes each code to fp32 (five integer ops and a multiply) and multiplies
in fp32; on the H200 it streamed gate_up at 37% of the copy ceiling, instruction-bound as the affine
fp32 GEMV was before qmv_h2. Here codes are decoded in pairs straight into fp16 bit patterns:

- decode: code bits 0-2 (exponent, mantissa) moved to fp16 bits 9-11 and the sign (bit 3) to bit 15
  read as fp16 give the code's value times 2^-14, for every code (e2m1's 0.5 is fp16's subnormal 2^-15,
  the others normal): two shifts and two masks per pair of codes (p, p + 4) of a word, no arithmetic.
- dot: activations are prepared by qmv_h2_prep with BIAS=14, so each group of x is scaled by a power
  of two to |x'| < 2^14; a product code * x' is then value * x / xs, below 6 in magnitude, and a word's
  four-pair fp16 partial sum below 48. The fp32 epilogue applies the group scale, xs * 2^14 (x is
  planes * xs; the codes were 2^-14 of their values) and the global scale, as fp4_qmv does.

The error is that of fp16 products and short fp16 sums (relative 2^-11 of a word's partial sum).
"""

from __future__ import annotations

import kilnx.dsl as kd
from kilnx.kernels import qmv_h2 as H
from kilnx.kernels.qmatmul_fp4 import (CODES_PER_WORD, OUT_DTYPES, TORCH_DTYPE_OF, _dense_product, _group_of, _key,
                                       _shift_left, _specialize, fp4_chunks, fp4_frame, fp4_store, make_fp4_args)
from kilnx.kernels.sizes import pow2_at_least, pow2_dividing

X_BIAS = 14                              # fp16 holds a code's value times 2^-14: x is prepared 2^14 larger
CODE_UNSCALE = 2.0 ** X_BIAS
MAGNITUDE_BITS = 0x0E000E00              # fp16 bits 9-11 of both halves
SIGN_BITS = -0x7FFF8000                  # 0x80008000 as an i32: fp16 bit 15 of both halves


def fp16_pair(words, p: int):
    """Codes p and p + 4 of each word (nibbles at bits 4p and 4p + 16) as the fp16 halves of a u32,
    each equal to the code's e2m1 value times 2^-14."""
    magnitude = _shift_left(words, 9 - 4 * p) & MAGNITUDE_BITS
    sign = _shift_left(words, 12 - 4 * p) & SIGN_BITS
    return (magnitude | sign).bitcast(kd.u32)


def _spec(planes, xs, wq, scales, global_scale, *, OUT="f32", **_):
    return _dense_product(H._x_of(planes, xs), wq, scales, global_scale, TORCH_DTYPE_OF[OUT])


def _default(planes, xs, wq, *_, **__):
    """The best of 15 configs (5 tiles x CHAIN 1, 2, 4) at one row on llama-3.1-8b's gate_up, H200
    (bench/results/2026-12-03_h200_quant_s10_fp4.csv): mxfp4 (group 32) 66.1% of copy, nvfp4 (group 16)
    66.2%, as the 4-bit affine qmv_h2 (66.4%)."""
    if not planes.is_cuda:
        return {}
    if 8 * wq.shape[1] // xs.shape[1] == 16:      # nvfp4's groups of 16
        return {"BLOCK_N": 16, "BLOCK_KW": 128, "num_warps": 2, "STAGES": 3, "CHAIN": 2}
    return {"BLOCK_N": 16, "BLOCK_KW": 128, "num_warps": 2, "STAGES": 3, "CHAIN": 4}


@kd.kernel(
    tune={"BLOCK_N": kd.pow2(1, 64, default=16), "BLOCK_KW": kd.pow2(8, 512, default=128),
          "SPLIT_K": kd.choice(1, 2, 4, 8, default=1),
          "num_warps": kd.choice(1, 2, 4, 8, default=4), "STAGES": kd.choice(1, 2, 3, 4, default=1),
          "CHAIN": kd.choice(1, 2, 4, default=1)},
    key=lambda planes, xs, wq, scales, gscale, **_: _key(planes.shape[0], wq, scales),
    spec=_spec, default=_default,
    specialize=lambda planes, xs, wq, scales, gscale: {
        **_specialize(wq, scales), "BLOCK_M": pow2_at_least(planes.shape[0]),
        "KW_DIV": pow2_dividing(wq.shape[1])})
def fp4_qmv_h2(planes, xs, wq, scales, global_scale, *, GROUP: kd.constexpr, E4M3: kd.constexpr,
               BLOCK_M: kd.constexpr, N_DIV: kd.constexpr, KW_DIV: kd.constexpr, OUT: kd.constexpr = "f32",
               BLOCK_N, BLOCK_KW, SPLIT_K, STAGES, CHAIN):
    """planes (M, 4, K/8) u32 and xs (M, K/GROUP) from qmv_h2_prep(BIAS=14), wq (N, K/8) words, scales
    (N, K/GROUP) uint8 codes, global_scale (1,) fp32 or None -> (M, N) in OUT (fp32 with split-K).
    CHAIN words share an fp16 accumulator (gemv.Frame.h2_group_dot)."""
    M = planes.shape[0]
    f = fp4_frame(wq, GROUP, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_KW=BLOCK_KW, SPLIT_K=SPLIT_K,
                  N_DIV=N_DIV, KW_DIV=KW_DIV, STAGES=STAGES)
    chain = min(CHAIN, f.WPG)
    acc = f.group_accumulator()
    for wc, g, words, s in fp4_chunks(f, wq, scales, E4M3):
        pairs = [fp16_pair(words, p) for p in kd.static_range(CODES_PER_WORD // 2)] if BLOCK_M > 1 else None
        for m in f.rows(M):
            qx_g = f.h2_group_dot(lambda p: fp16_pair(words, p), pairs, planes, m, wc, CODES_PER_WORD // 2, chain)
            # x = planes * xs and the codes are value * 2^-14: the group's sum times s * xs * 2^14
            f.add_group_terms(acc, qx_g * s * (f.per_x_row(xs, m, g) * CODE_UNSCALE)[None, :], m)
    return fp4_store(f, f.group_results(acc), global_scale, M, OUT, SPLIT_K)


def run_fp4_qmv_h2(x, wq, scales, global_scale=None, *, backend=None, config=None, prep_config=None):
    """x (M, K) -> (M, N) in x.dtype: qmv_h2's activation prep (2^14 larger), then the fp16 GEMV."""
    planes, _, xs = H.qmv_h2_prep(x, PER=CODES_PER_WORD, GROUP=_group_of(wq, scales), BIAS=X_BIAS,
                                  backend=backend, config=prep_config)
    y = fp4_qmv_h2(planes, xs, wq, scales, global_scale, OUT=OUT_DTYPES.get(x.dtype, "f32"),
                   backend=backend, config=config)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def make_fp4_qmv_h2_args(problem: dict, device: str):
    x, wq, scales, gscale = make_fp4_args(problem, device)
    planes, _, xs = H._prep_spec(x.cpu(), PER=CODES_PER_WORD, GROUP=_group_of(wq, scales), BIAS=X_BIAS)
    return planes.to(device), xs.to(device), wq, scales, gscale


def _tolerance(args):
    from kilnx.kernels.qmatmul_fp4 import _tolerance as fp32_tolerance
    planes, xs, wq, scales, gscale = args
    return fp32_tolerance((H._x_of(planes, xs), wq, scales, gscale))


fp4_qmv_h2.tuning(make_args=make_fp4_qmv_h2_args,
                  problems=[{"M": m, "N": 4096, "K": 4096, "mode": mode} for mode in ("mxfp4", "nvfp4") for m in (1, 4)])
fp4_qmv_h2.tolerance = _tolerance
