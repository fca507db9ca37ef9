"""Quantized matmul in the DSL: y = x @ dequantize(w).T for MLX-affine weights.

- `qmv_prep` + `qmv`: M <= 16 rows and 2/4/8-bit codes (whole codes per 32-bit word). The prep kernel
  lays each row of x out as fp32 "planes" (plane j holds x[w * PER + j] for word w) and sums x per
  quantization group, so the GEMV's inner loop loads x contiguously, in the layout of the packed
  words, with no conversions. The GEMV loads whole words along K, unrolls the PER code positions,
  and applies scale and bias once per group to partial sums:
      sum_k w_k x_k = sum_g s_g * sum_{k in g} q_k x_k + b_g * sum_{k in g} x_k.
  With MAGIC, a code becomes a float without an int->float conversion (a quarter-rate instruction
  on sm_90): OR-ing it into the mantissa of 2^23 gives 2^23 + code * 2^s exactly, and one fma
  removes the offset. One pass over the weight serves every row; SPLIT_K > 1 splits K across
  programs that add into an fp32 output with atomics.
- `qmm`: any M, any bit width, a tiled GEMM that dequantizes a weight tile in registers and
  multiplies with kd.dot. 2/4/8-bit codes are read as whole words along K and expanded with a
  broadcast shift; 3/5/6-bit codes (which may straddle words) are read per element. With SWAP the
  weight tile is the dot's left operand (out^T = W x^T), so a few rows of x still fill the tensor
  cores' wide dimension.
- `mm`: the dense tiled GEMM, for weights kept unquantized.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd
from kilnx.dsl.kernel import PerObjectMemo
from kilnx.kernels import _gemv as gemv
from kilnx.kernels import bf16_decode
from kilnx.kernels.dense_mm import dense_gemv, dot_tolerance, mm, sm_count, takes_dense_gemv
from kilnx.kernels.sizes import pow2_at_least, pow2_dividing


def _format_of(x, wq, scales, biases):
    """Bit width and group size follow from the shapes: K*bits/32 words and K/group scales per row."""
    k = x.shape[1]
    return {"BITS": wq.shape[1] * 32 // k, "GROUP": k // scales.shape[1]}


def _qmv_key(x, wq, scales, biases, **kw):
    f = _format_of(x, wq, scales, biases)
    return {"M": x.shape[0], "N": wq.shape[0], "K": x.shape[1], "bits": f["BITS"], "gs": f["GROUP"]}


def dequantize_on_device(wq, scales, biases, bits: int, group: int) -> torch.Tensor:
    """The fp32 dense weight, computed where the tensors live, for 2/4/8-bit codes (whole codes per word).

    Equal to QWeight.dequantize (the numpy reference; tests/kernels/test_qmatmul.py checks it) but fast
    on the GPU: the tuner's correctness gate needs the dense product of 100M+-weight matrices, which
    the numpy reference took seconds to make per draw and so starved the big buckets of trials."""
    n, kw = wq.shape
    shifts = torch.arange(0, 32, bits, device=wq.device, dtype=torch.int32)
    codes = (wq.to(torch.int32)[:, :, None] >> shifts) & ((1 << bits) - 1)   # arithmetic >>, then masked
    q = codes.reshape(n, -1, group).float()
    return (q * scales.float()[..., None] + biases.float()[..., None]).reshape(n, kw * 32 // bits)


def _dense_spec(x, wq, scales, biases, bits, group, dtype=None):
    if 32 % bits == 0:
        w = dequantize_on_device(wq, scales, biases, bits, group)
        return (x.double() @ w.double().T).to(dtype or x.dtype)
    from kilnx.quant import QWeight
    w = QWeight.from_mlx(wq.cpu(), scales.cpu(), biases.cpu(), bits=bits, group_size=group)
    y = x.double().cpu() @ w.dequantize(torch.float32).double().T
    return y.to(dtype or x.dtype).to(x.device)


def _code(words, hi, j: int, bits: int, magic: bool):
    """Code j of each packed word (bits j*bits ...) as an exact fp32 value."""
    mask, shift = (1 << bits) - 1, j * bits
    if not magic:
        return ((words >> shift) & mask).f32()
    src, s = (words, shift) if shift < 16 else (hi, shift - 16)
    f = ((src & (mask << s)) | 0x4B000000).bitcast(kd.f32)    # 2^23 + code * 2^s, exactly
    return f * (2.0 ** -s) - 2.0 ** (23 - s)                   # the code, exactly: one fma


# ---- qmv: activations prepared once, then one pass over the packed weight --------------------------
def _planes_of(x, per):
    """The prep kernel's meaning in torch: planes (M, PER, K/PER) with planes[m, j, w] = x[m, w*PER+j]."""
    m, k = x.shape
    return x.float().reshape(m, k // per, per).transpose(1, 2).contiguous()


def _x_of(planes):
    m, per, kw = planes.shape
    return planes.transpose(1, 2).reshape(m, per * kw)


@kd.kernel(tune={"BLOCK_KW": kd.pow2(16, 512, default=128), "num_warps": kd.choice(1, 2, 4, default=4)},
           key=lambda x, **kw: {"M": x.shape[0], "K": x.shape[1]},
           spec=lambda x, *, PER, GROUP, **_: (_planes_of(x, PER),
                                                x.float().reshape(x.shape[0], -1, GROUP).sum(-1)))
def qmv_prep(x, *, PER: kd.constexpr, GROUP: kd.constexpr, BLOCK_KW):
    M, K = x.shape
    WPG = GROUP // PER                    # words per group
    BW = max(BLOCK_KW, WPG)               # whole groups per program
    NG = BW // WPG
    row, pw = kd.grid(M, kd.cdiv(kd.cdiv(K, PER), BW))
    w = pw * BW + kd.arange(0, BW)
    j = kd.arange(0, PER)
    v = kd.load(x, row, w[:, None] * PER + j[None, :]).f32()           # (BW, PER), contiguous in x
    planes = kd.output((M, PER, K // PER), kd.f32, name="planes")
    kd.store(planes, row, j[:, None], w[None, :], kd.trans(v))
    sums = kd.output((M, K // GROUP), kd.f32, name="group_sums")
    kd.store(sums, row, pw * NG + kd.arange(0, NG), kd.sum(kd.reshape(v, (NG, WPG * PER)), axis=1))
    return planes, sums


def _qmv_format(planes, sums, wq, scales, biases):
    per = planes.shape[1]
    return {"BITS": 32 // per, "GROUP": per * planes.shape[2] // scales.shape[1]}


def _qmv_key_prepared(planes, sums, wq, scales, biases, **kw):
    f = _qmv_format(planes, sums, wq, scales, biases)
    return {"M": planes.shape[0], "N": wq.shape[0], "K": planes.shape[1] * planes.shape[2],
            "bits": f["BITS"], "gs": f["GROUP"]}


def _qmv_default(planes, *_, **__):
    """On the CPU (numba) small tiles win: 8 rows x 16 words was the best or near it on every SmolLM2
    shape, 2.2-3.0x faster than the GPU's default there (2 cores, EPYC); and the plain shift-and-convert
    decode beats the magic-number one there (a vector int->float convert is one instruction on x86, the
    magic path two: a SmolLM2 decode step 72-75 against 80-88 ms)."""
    return {"BLOCK_N": 8, "BLOCK_KW": 16, "MAGIC": False} if planes.device.type == "cpu" else {}


def _qmv_spec(planes, sums, wq, scales, biases, *, BITS, GROUP, **_):
    return _dense_spec(_x_of(planes), wq, scales, biases, BITS, GROUP, dtype=scales.dtype)


@kd.kernel(
    tune={"BLOCK_N": kd.pow2(1, 64, default=8), "BLOCK_KW": kd.pow2(8, 512, default=128),
          "SPLIT_K": kd.choice(1, 2, 4, 8, default=1), "MAGIC": kd.boolean(default=True),
          "num_warps": kd.choice(1, 2, 4, 8, default=4), "STAGES": kd.choice(1, 2, 3, 4, default=1)},
    key=_qmv_key_prepared, spec=_qmv_spec, default=_qmv_default,
    specialize=lambda p, s, wq, sc, b: {**_qmv_format(p, s, wq, sc, b), "BLOCK_M": pow2_at_least(p.shape[0]),
                                         "N_DIV": pow2_dividing(wq.shape[0]), "KW_DIV": pow2_dividing(wq.shape[1])})
def qmv(planes, sums, wq, scales, biases, *, BITS: kd.constexpr, GROUP: kd.constexpr,
        BLOCK_M: kd.constexpr, N_DIV: kd.constexpr, KW_DIV: kd.constexpr, BLOCK_N, BLOCK_KW, SPLIT_K, MAGIC,
        STAGES):
    M = planes.shape[0]
    N, KW = wq.shape
    PER = 32 // BITS                 # codes per word
    f = gemv.Frame(N, KW, WPG=GROUP // PER, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_KW=BLOCK_KW,
                   SPLIT_K=SPLIT_K, N_DIV=N_DIV, KW_DIV=KW_DIV, STAGES=STAGES)
    acc = kd.zeros((BLOCK_M, BLOCK_N), kd.f32)
    for w0 in f.chunks():
        wc, g, words = f.chunk(wq, w0)
        hi = words >> 16
        s, b = f.per_weight_row(scales, g).f32(), f.per_weight_row(biases, g).f32()
        codes = [_code(words, hi, j, BITS, MAGIC) for j in kd.static_range(PER)]
        for m in f.rows(M):   # every row reuses the codes in registers
            qx_g = f.per_group(f.dot(codes, planes, m, wc))
            row = kd.sum(qx_g * s + b * f.per_x_row(sums, m, g)[None, :], axis=1)
            acc += gemv.into_row(row, m, BLOCK_M)
    return f.store(acc, M, N, scales.dtype, SPLIT_K)


def run_qmv(x, wq, scales, biases, *, backend=None, config=None, prep_config=None):
    """x (M, K) -> (M, N) in scales' dtype (fp32 with split-K): prep then the GEMV."""
    f = _format_of(x, wq, scales, biases)
    planes, sums = qmv_prep(x, PER=32 // f["BITS"], GROUP=f["GROUP"], backend=backend, config=prep_config)
    return qmv(planes, sums, wq, scales, biases, backend=backend, config=config)


# ---- qmm: tile GEMM with the dequantization in the prologue ------------------------------------------
def _qmm_default(x, wq, scales, biases, *, BITS, **_):
    m = x.shape[0]
    if x.is_cuda and m > 16 and bf16_decode.serves(BITS, x.dtype, scales.dtype):
        # codes decoded in bf16 pairs, the weight the MMA's left operand: llama-3.1-8b gate_up on the H200,
        # M=64 93 us, 128 99, 256 188, against 133 / 131 / 243 on the fp32 decode's defaults
        # (bench/results/2026-12-04_h200_quant_s15_qmm.csv)
        tile = _packed_tile(m, wq.shape[0], sm_count(x))
        return {**tile, "SWAP": True, "MAGIC": True, "PACKED": True, "num_stages": 3}
    if m <= 16:   # few rows: the weight fills the wide side of the MMA (best measured on H200 at M=8)
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "SWAP": True, "num_warps": 4, "num_stages": 4}
    if m <= 64 and not x.is_cuda:
        # numba, 2 EPYC cores, SmolLM2-135M's four projections at 40 and 64 rows: 1.42-1.78x faster than the
        # swapped 64 x 128 tile below (0.92-4.5 ms against 1.41-8.0, alternated runs)
        return {"BLOCK_M": max(16, pow2_at_least(m)), "BLOCK_N": 64, "BLOCK_K": 64, "SWAP": False}
    if m <= 64:
        return {"BLOCK_M": max(16, pow2_at_least(m)), "BLOCK_N": 64, "BLOCK_K": 128, "SWAP": True,
                "num_warps": 4}
    if x.is_cuda:   # the tuner's winner at M = 512 and 2048 on 8 of the 10 llama-3.1-8b buckets, 6-24% over
        # the space default (H200, bench/results/2026-12-03_h200_tune_s6_full.csv)
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "MAGIC": False, "SWAP": False, "num_warps": 4,
                "num_stages": 2}
    return {}


def _packed_tile(m: int, n: int, sms: int) -> dict:
    """The packed fused kernel's default tile above 16 rows: 64 wide up to 64 rows, and up to
    routing.NARROW_TILE_MAX_ROWS where 128-wide tiles would leave SMs idle (o at 128 rows 28 us against 85,
    H200, session 16); else 128 x 128 x 64 over 8 warps."""
    from kilnx.kernels.routing import NARROW_TILE_MAX_ROWS, starved
    if m <= 64:
        return {"BLOCK_M": max(16, pow2_at_least(m)), "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4}
    if m <= NARROW_TILE_MAX_ROWS and starved(m, n, sms):
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8}


def _qmm_spec(x, wq, scales, biases, *, BITS, GROUP, **_):
    return _dense_spec(x, wq, scales, biases, BITS, GROUP)


@kd.kernel(
    tune={"BLOCK_M": kd.pow2(16, 256, default=128), "BLOCK_N": kd.pow2(16, 256, default=128),
          "BLOCK_K": kd.pow2(32, 256, default=64), "MAGIC": kd.boolean(default=True),
          "SWAP": kd.boolean(default=False), "num_warps": kd.choice(2, 4, 8, default=8),
          "num_stages": kd.choice(1, 2, 3, 4, default=3), "PACKED": kd.boolean(default=False)},
    key=_qmv_key, spec=_qmm_spec, default=_qmm_default,
    specialize=lambda x, wq, s, b: {**_format_of(x, wq, s, b), "N_DIV": pow2_dividing(wq.shape[0]),
                                    "K_DIV": pow2_dividing(x.shape[1])})
def qmm(x, wq, scales, biases, *, BITS: kd.constexpr, GROUP: kd.constexpr, N_DIV: kd.constexpr,
        K_DIV: kd.constexpr, BLOCK_M, BLOCK_N, BLOCK_K, MAGIC, SWAP, PACKED):
    """PACKED: 4-bit codes with bf16 activations and scales decode two at a time into bf16 pairs
    (kernels/bf16_decode.py); other formats ignore it."""
    M, K = x.shape
    N = wq.shape[0]
    MASK = (1 << BITS) - 1
    N_IN = N_DIV % BLOCK_N == 0      # whole blocks along N and K: no masks there
    K_IN = K_DIV % BLOCK_K == 0
    NG = max(BLOCK_K // GROUP, 1)    # quantization groups per K step
    pm, pn = kd.grid(kd.cdiv(M, BLOCK_M), kd.cdiv(N, BLOCK_N))
    rm = pm * BLOCK_M + kd.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + kd.arange(0, BLOCK_N)
    acc = kd.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), kd.f32)
    packed = PACKED and bf16_decode.serves(BITS, x.dtype, scales.dtype)
    for k0 in kd.range(0, K, BLOCK_K):
        rk = k0 + kd.arange(0, BLOCK_K)
        if packed:
            kw = k0 // 8 + kd.arange(0, BLOCK_K // 8)
            g = k0 // GROUP + kd.arange(0, NG)
            chk = (not N_IN, not K_IN)
            w = bf16_decode.weight_tile(kd.load(wq, rn[:, None], kw[None, :], check=chk),
                                        kd.load(scales, rn[:, None], g[None, :], check=chk),
                                        kd.load(biases, rn[:, None], g[None, :], check=chk))
        else:
            if 32 % BITS == 0:
                # whole words along K (contiguous, coalesced), codes expanded by a broadcast shift:
                # code j of word w is element k = w * PER + j
                PER = 32 // BITS
                kw = k0 // PER + kd.arange(0, BLOCK_K // PER)
                words = kd.load(wq, rn[:, None], kw[None, :], check=(not N_IN, not K_IN))
                shifts = kd.arange(0, PER) * BITS
                q = kd.reshape((words[:, :, None] >> shifts[None, None, :]) & MASK, (BLOCK_N, BLOCK_K))
            else:
                # codes may straddle two words: read the bit window per element
                bit = rk * BITS
                wi = (bit >> 5)[None, :]
                sh = (bit & 31)[None, :]
                lo = kd.load(wq, rn[:, None], wi).to(kd.u32) >> sh.to(kd.u32)
                spill = sh > 32 - BITS
                hi = kd.load(wq, rn[:, None], wi + 1, mask=spill).to(kd.u32) << ((32 - sh) & 31).to(kd.u32)
                q = ((lo | kd.where(spill, hi, 0)) & MASK).to(kd.i32)
            # codes are small: OR-ing them into 2^23's mantissa is an exact int->float without a convert
            qf = (q | 0x4B000000).bitcast(kd.f32) - 8388608.0 if MAGIC else q.f32()
            # one scale and bias per row and group, broadcast over the group's codes (a load per element
            # would issue BLOCK_K loads per row)
            g = k0 // GROUP + kd.arange(0, NG)
            chk = (not N_IN, not K_IN)
            s = kd.load(scales, rn[:, None], g[None, :], check=chk).f32()
            b = kd.load(biases, rn[:, None], g[None, :], check=chk).f32()
            if BLOCK_K > GROUP:
                qf = kd.reshape(qf, (BLOCK_N, NG, GROUP))
                w = kd.reshape(qf * s[:, :, None] + b[:, :, None], (BLOCK_N, BLOCK_K))
            else:
                w = qf * s + b
        if SWAP:
            acc += kd.dot(w.to(x.dtype), kd.load(x, rm[None, :], rk[:, None], check=(True, not K_IN)))
        else:
            acc += kd.dot(kd.load(x, rm[:, None], rk[None, :], check=(True, not K_IN)), kd.trans(w).to(x.dtype))
    out = kd.output((M, N), x.dtype)
    if SWAP:
        kd.store(out, rm[None, :], rn[:, None], acc)
    else:
        kd.store(out, rm[:, None], rn[None, :], acc)
    return out


# ---- dequant: the whole weight to 16-bit, for large M where a dense GEMM then runs at full rate ----
def _dequant_spec(wq, scales, biases, *, BITS, GROUP, **_):
    return dequantize_on_device(wq, scales, biases, BITS, GROUP).to(scales.dtype)


@kd.kernel(tune={"BLOCK_N": kd.pow2(1, 64, default=16), "BLOCK_KW": kd.pow2(8, 256, default=32),
                 "num_warps": kd.choice(2, 4, 8, default=4)},
           key=lambda wq, s, b, *, BITS, GROUP, **_: {"N": wq.shape[0], "K": wq.shape[1] * 32 // BITS},
           spec=_dequant_spec)
def dequant(wq, scales, biases, *, BITS: kd.constexpr, GROUP: kd.constexpr, BLOCK_N, BLOCK_KW):
    """(N, K*BITS/32) packed 2/4/8-bit words -> (N, K) in the scales' dtype."""
    N, KW = wq.shape
    PER = 32 // BITS
    BK = BLOCK_KW * PER
    NG = max(BK // GROUP, 1)
    pn, pk = kd.grid(kd.cdiv(N, BLOCK_N), kd.cdiv(KW, BLOCK_KW))
    n = pn * BLOCK_N + kd.arange(0, BLOCK_N)
    wc = pk * BLOCK_KW + kd.arange(0, BLOCK_KW)
    words = kd.load(wq, n[:, None], wc[None, :])
    shifts = kd.arange(0, PER) * BITS
    q = kd.reshape((words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1), (BLOCK_N, BK))
    qf = (q | 0x4B000000).bitcast(kd.f32) - 8388608.0
    k = pk * BK + kd.arange(0, BK)
    if BK > GROUP:
        g = pk * NG + kd.arange(0, NG)
        s = kd.load(scales, n[:, None], g[None, :]).f32()
        b = kd.load(biases, n[:, None], g[None, :]).f32()
        w = kd.reshape(kd.reshape(qf, (BLOCK_N, NG, GROUP)) * s[:, :, None] + b[:, :, None], (BLOCK_N, BK))
    else:
        g = (pk * BK) // GROUP
        w = qf * kd.load(scales, n[:, None], g).f32() + kd.load(biases, n[:, None], g).f32()
    out = kd.output((N, KW * PER), scales.dtype)
    kd.store(out, n[:, None], k[None, :], w)
    return out


def dequant_mm(x, wq, scales, biases, *, config=None, dequant_config=None):
    """x @ dequantize(w).T as two kernels: the weight to 16-bit once, then the dense GEMM. (Slices of the
    weight dequantized and multiplied in turn, so that each 16-bit slice might stay in L2, were slower on
    the H200: gate_up at M=512 304 us with 4096-row slices against 285 whole, commit 41fdd44's probe,
    bench/results/2026-12-04_h200_mm_prefill_chunks_s14.csv.)"""
    f = _format_of(x, wq, scales, biases)
    w = dequant(wq, scales, biases, BITS=f["BITS"], GROUP=f["GROUP"], config=dequant_config)
    return mm(x, w.to(x.dtype), config=config)


# Rows up to which the one-pass GEMV beats the swapped tile GEMM where nothing was tuned (H200, llama-3.1-8b
# shapes: the packed-fp16 qmv_h2 won at M=8 on all four, 19-95 us against 23-104 us; the fp32 qmv had lost
# at 8); `kilnx tune` stores the measured crossover per device and weight shape (kilnx/kernels/routing.py).
QMV_MAX_ROWS = 8

_SERVED = PerObjectMemo()
"""weight, (rows, K, dtype, device) -> its call: a qmatmul call's checks, routing and format decided once."""


def qmatmul(x: torch.Tensor, w) -> torch.Tensor:
    """x (..., K) @ w.T for a QWeight (affine) or a dense (N, K) tensor -> (..., N) in x.dtype."""
    from kilnx.quant import QWeight
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    key = (x2.shape[0], k, x.dtype, x.device)
    served = _SERVED.get((w,), key)
    if served is not PerObjectMemo.MISSING:
        return served(x2, w.packed, w.scales, w.biases).reshape(*lead, w.shape[0])
    if not isinstance(w, QWeight):
        if w.dim() != 2 or w.shape[1] != k:
            raise ValueError(f"qmatmul: weight shape {tuple(w.shape)} does not match x's last dim {k}")
        return (dense_gemv(x2, w) if takes_dense_gemv(x2) else mm(x2, w)).reshape(*lead, w.shape[0])
    if w.mode in ("mxfp4", "nvfp4"):
        from kilnx.kernels.qmatmul_fp4 import fp4_qmatmul
        return fp4_qmatmul(x, w)
    if w.mode != "affine":
        raise NotImplementedError(f"qmatmul has no kernel for mode {w.mode!r} yet (affine, mxfp4, nvfp4); "
                                  "use w.dequantize() for a dense weight")
    if w.shape[-1] != k or len(w.shape) != 2:
        raise ValueError(f"qmatmul: weight {w.shape} does not match x's last dim {k}")
    if x2.shape[0] == 0:
        return x.new_empty(*lead, w.shape[0])
    args = (x2, w.packed, w.scales, w.biases)
    from kilnx.kernels.routing import qmatmul_rows
    # which GEMV, and up to how many rows, is the tuned choice of this device (kilnx tune stores it)
    call = _SERVED.put((w,), key, qmatmul_rows.server(*args, qmatmul_rows.choice_for(*args)))
    return call(*args).reshape(*lead, w.shape[0])


def make_qmatmul_args(problem: dict, device: str):
    """Random packed words and small random scales/biases: a valid QWeight without quantizing on
    the host (quantizing 8B weights with the numpy reference would take minutes)."""
    m, n, k = problem["M"], problem["N"], problem["K"]
    bits, gs = problem.get("bits", 4), problem.get("gs", 64)
    g = torch.Generator(device="cpu").manual_seed(m * 7919 + n * 31 + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
    wq = torch.randint(-2**31, 2**31 - 1, (n, k * bits // 32), generator=g, dtype=torch.int64)
    wq = wq.to(torch.int32).to(device)
    scales = (torch.rand(n, k // gs, generator=g) * 0.02 + 0.001).to(torch.bfloat16).to(device)
    biases = (-scales.float() * (2 ** (bits - 1))).to(torch.bfloat16)
    return x, wq, scales, biases


def _dense_peer(x, wq, scales, biases):
    """cuBLAS (torch.matmul) on the dequantized bf16 weight: the peer a quantized kernel must beat."""
    cached = getattr(_dense_peer, "_cache", None)
    # the packed tensor itself is kept and compared: an id alone can be reused by a later tensor
    if cached is None or cached[0] is not wq or cached[1] is not scales:
        cached = (wq, scales, _dense_spec_weight(x, wq, scales, biases))
        _dense_peer._cache = cached
    return x @ cached[2].T


def _dense_spec_weight(x, wq, scales, biases):
    f = _format_of(x, wq, scales, biases)
    if 32 % f["BITS"] == 0:
        return dequantize_on_device(wq, scales, biases, f["BITS"], f["GROUP"]).to(torch.bfloat16)
    from kilnx.quant import QWeight
    q = QWeight.from_mlx(wq.cpu(), scales.cpu(), biases.cpu(), bits=f["BITS"], group_size=f["GROUP"])
    return q.dequantize(torch.bfloat16).to(x.device)


def make_qmv_args(problem: dict, device: str):
    """qmv's own inputs: the prepared activations (what qmv_prep makes) with the packed weight."""
    x, wq, scales, biases = make_qmatmul_args(problem, device)
    f = _format_of(x, wq, scales, biases)
    sums = x.float().reshape(x.shape[0], -1, f["GROUP"]).sum(-1)
    return _planes_of(x, 32 // f["BITS"]), sums, wq, scales, biases


def _dense_peer_prepared(planes, sums, wq, scales, biases):
    return _dense_peer(_x_of(planes).to(scales.dtype), wq, scales, biases)


QMV_PROBLEMS = [{"M": m, "N": 4096, "K": 4096, "bits": 4, "gs": 64} for m in (1, 4)]
QMM_PROBLEMS = [{"M": 512, "N": 4096, "K": 4096, "bits": 4, "gs": 64}]
qmv.tuning(make_args=make_qmv_args, problems=QMV_PROBLEMS, peer=_dense_peer_prepared)
# Seeds with many rows per thread (x is reused from registers across rows; measured x traffic through
# L1 is what caps the one-row GEMV) and the configs the H200 sweep found best.
qmv.seed_configs = lambda problem: [
    {"BLOCK_N": bn, "BLOCK_KW": kw, "num_warps": nw, "STAGES": ns, "SPLIT_K": 1, "MAGIC": True}
    for bn, kw, nw, ns in [(32, 128, 4, 3), (16, 128, 2, 3), (32, 64, 2, 3), (64, 128, 8, 2), (16, 64, 1, 3),
                           (4, 512, 4, 2), (4, 256, 4, 3), (32, 128, 8, 3)]]
qmm.seed_configs = lambda problem: (
    [{"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": ns, "SWAP": True, "MAGIC": True}
     for bn, bk, ns in [(32, 256, 4), (64, 128, 3), (32, 128, 4)]] if problem["M"] <= 16 else
    [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns, "SWAP": False, "MAGIC": True}
     for bm, bn, bk, nw, ns in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 32, 4, 4)]] +
    # the packed bf16 decode with the weight as the MMA's left operand (the GPU's default above 16 rows)
    [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": 3, "SWAP": True, "MAGIC": True,
      "PACKED": True} for bm, bn, bk, nw in [(128, 128, 64, 8), (64, 64, 128, 4), (128, 64, 64, 4)]])
qmm.tuning(make_args=make_qmatmul_args, problems=QMM_PROBLEMS, peer=_dense_peer)


def _matmul_tolerance(args):
    """(rtol, atol) for a K-long dot of bf16-rounded operands: elementwise relative error is
    meaningless where the sum cancels, so atol scales with sqrt(K) x rms(x) x the largest weight."""
    if len(args) == 5:   # qmv's prepared activations
        args = (_x_of(args[0]), *args[2:])
    x, wq, scales, biases = args
    return affine_tolerance(x, scales, biases, _format_of(*args)["BITS"])


def affine_tolerance(x, scales, biases, bits: int):
    """dot_tolerance for x against an affine weight, whose largest element is at most max|s| (2^bits - 1) + max|b|."""
    return dot_tolerance(x, scales.float().abs().max().item() * (2 ** bits - 1) + biases.float().abs().max().item())


qmv.tolerance = _matmul_tolerance
qmm.tolerance = _matmul_tolerance
