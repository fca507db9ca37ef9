"""Quantized matmul for MLX's fp4 formats: y = x @ dequantize(w).T with w in mxfp4 or nvfp4.

Both formats pack eight e2m1 codes per 32-bit word (element k of a row is nibble k % 8 of word k // 8,
bit 3 the sign, bits 1-2 the exponent, bit 0 the mantissa) and scale each group of codes with one
uint8 code: mxfp4 groups 32 codes under an e8m0 exponent 2^(e-127), nvfp4 groups 16 under an e4m3
float, and may multiply everything by global_scale / (448 * 6) (kilnx/quant/mlx_formats.py holds the
bit-exact numpy meaning). There is no bias, so the sum splits per group:
    sum_k w_k x_k = sum_g scale_g * sum_{k in g} e2m1(q_k) x_k.

- `fp4_qmv` (few rows): one pass over the packed words, activations prepared by the affine GEMV's
  `qmv_prep` (planes laid out like the words, so x arrives in the words' register layout), the eight
  nibble positions unrolled, each scale applied once per group to a partial sum.
- `fp4_qmm` (many rows): a tile GEMM that decodes a weight tile in registers and multiplies with
  kd.dot (tensor cores). Decoded values times scales have at most 6 significant bits, so the 16-bit
  dot operand is exact; SWAP makes the weight the left operand so a few rows still fill the MMA.

Decoding e2m1 without a table: the code's exponent and mantissa bits are placed into the top of fp32's
exponent/mantissa fields and its sign into bit 31, so the float read back is the code's value times
2^-126 for every code, zero and the subnormal 0.5 included (fp32's subnormals have the same shape as
e2m1's), and one multiply by 2^126 restores it. That is five integer ops and a multiply per element,
all full-rate, where a value table would need a gather from memory or a chain of 8+ selects. fp32
subnormals are kept by the GPU code (Triton flushes them only inside libdevice functions; the sm_90
compile test checks the PTX has no .ftz), by numpy and by numba, so the decode is exact everywhere. Scales are decoded per group, where a few selects
cost nothing, so their special cases (e8m0's 2^-127, e4m3's subnormals and NaN) are spelled out.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd
from kilnx.kernels import _gemv as gemv
from kilnx.quant.mlx_formats import FP_MODES
from kilnx.kernels.sizes import pow2_at_least, pow2_dividing

# MLX's fp4 modes differ in group size, which is how kernels tell them apart from the shapes alone.
FP4_MODE_OF_GROUP = {spec.group_size: name for name, spec in FP_MODES.items() if spec.bits == 4}
NVFP4_GLOBAL_RANGE = 448.0 * 6.0   # nvfp4 scales are stored relative to global_scale / (e4m3 max * e2m1 max)
CODES_PER_WORD = 8
SIGN_BIT = -(1 << 31)              # 0x80000000 as an i32 constant
E2M1_UNSCALE = 2.0 ** 126          # undoes the 2^-126 of reading e2m1's bits as fp32 (see the docstring)
OUT_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
TORCH_DTYPE_OF = {v: k for k, v in OUT_DTYPES.items()}


def _group_of(wq, scales) -> int:
    return wq.shape[1] * CODES_PER_WORD // scales.shape[1]


# ---- decoding, shared by both kernels ---------------------------------------------------------------
def _shift_left(v, s: int):
    return v if s == 0 else v << s if s > 0 else v >> -s


def _e2m1(words, j: int = 0):
    """Nibble j of each i32 word as its exact fp32 value (bits outside the nibble are ignored).
    With a Python int j the shifts fold into constants: the GEMV's unrolled code positions."""
    sign = _shift_left(words, 28 - 4 * j) & SIGN_BIT          # code bit 3 -> fp32 sign
    magnitude = _shift_left(words, 22 - 4 * j) & (7 << 22)    # code bits 0-2 -> fp32 bits 22-24
    return (sign | magnitude).bitcast(kd.f32) * E2M1_UNSCALE


def _e8m0(codes):
    """mxfp4 scale codes -> 2^(e-127) in fp32, as MLX's exp2: code 0 is the subnormal 2^-127 (bit 22),
    255 is inf; every other code is just the exponent field."""
    e = codes.to(kd.i32)
    return kd.where(e == 0, 1 << 22, e << 23).bitcast(kd.f32)


def _e4m3(codes):
    """nvfp4 scale codes (e4m3fn) -> fp32, 0x7F/0xFF as NaN (e4m3fn has no inf). The code's 7 magnitude
    bits placed at fp32 bits 20-26 (exponent field low 4 bits, mantissa top 3) with its sign at bit 31
    read as fp32 are the code's value times 2^-120 for every code: normals differ only in the exponent
    bias (7 against 127), and the subnormals land on fp32 subnormals, scaled alike. One multiply by 2^120
    finishes (exact: the GPU's fp32 multiply keeps subnormal inputs unless told to flush them, and
    Triton does not). Against the earlier decode (separate normal and subnormal paths, a signed select)
    it takes the nvfp4 GEMV's main loop on gate_up from 1081 to 1040 sm_90 SASS instructions at CHAIN 1,
    990 to 951 at CHAIN 2 (16 scales per thread and chunk; bench/probes/sass_count.py)."""
    c = codes.to(kd.i32)
    bits = ((c << 20) & 0x07F00000) | ((c << 24) & SIGN_BIT)
    return kd.where((c & 0x7F) == 0x7F, 0x7FC00000, bits).bitcast(kd.f32) * 2.0 ** 120


def _group_scales(codes, e4m3: bool):
    return _e4m3(codes) if e4m3 else _e8m0(codes)


def _global_factor(global_scale, like):
    """nvfp4's global_scale / (448 * 6) (MLX's inv_encode), as a tile shaped like `like`; read from
    memory so a new global scale needs no new compile. A multiply by the rounded reciprocal (within an
    ulp of MLX's division) rather than a division, which Triton lowers to div.approx on the GPU."""
    return kd.load(global_scale, like * 0, check=False) * (1.0 / NVFP4_GLOBAL_RANGE)


# ---- the meaning of both kernels, for tests and the tuner's gate ------------------------------------
def dense_weight(wq, scales, global_scale=None) -> torch.Tensor:
    """The fp32 weight MLX's dequantize gives for these arrays (on the CPU)."""
    from kilnx.quant import QWeight
    mode = FP4_MODE_OF_GROUP[_group_of(wq, scales)]
    gs = None if global_scale is None else global_scale.cpu().reshape(())
    return QWeight.from_mlx(wq.cpu(), scales.cpu(), mode=mode, global_scale=gs).dequantize(torch.float32)


def _dense_product(x, wq, scales, global_scale, dtype):
    y = x.double().cpu() @ dense_weight(wq, scales, global_scale).double().T
    return y.to(dtype).to(x.device)


def _specialize(wq, scales):
    group = _group_of(wq, scales)
    if group not in FP4_MODE_OF_GROUP:
        raise ValueError(f"fp4 weights have groups of {sorted(FP4_MODE_OF_GROUP)}; these have {group}")
    return {"GROUP": group, "E4M3": FP_MODES[FP4_MODE_OF_GROUP[group]].e4m3_scale,
            "N_DIV": pow2_dividing(wq.shape[0])}


def _key(rows, wq, scales):
    return {"M": rows, "N": wq.shape[0], "K": wq.shape[1] * CODES_PER_WORD,
            "mode": FP4_MODE_OF_GROUP.get(_group_of(wq, scales), "?")}


# ---- fp4_qmv: one pass over the packed words for a few rows ----------------------------------------
def _x_of(planes):
    m, per, kw = planes.shape
    return planes.transpose(1, 2).reshape(m, per * kw)


# the H200's best for nvfp4 (mxfp4's was 32 rows x 8 warps, 3% faster) on gate_up at one row, of 12
_FP4_GPU_DEFAULT = {"BLOCK_N": 16, "BLOCK_KW": 64, "num_warps": 4, "STAGES": 3}


@kd.kernel(
    tune={"BLOCK_N": kd.pow2(1, 64, default=8), "BLOCK_KW": kd.pow2(8, 512, default=128),
          "SPLIT_K": kd.choice(1, 2, 4, 8, default=1),
          "num_warps": kd.choice(1, 2, 4, 8, default=4), "STAGES": kd.choice(1, 2, 3, 4, default=1)},
    default=lambda planes, *_, **__: _FP4_GPU_DEFAULT if planes.is_cuda else {},
    key=lambda planes, wq, scales, gscale, **_: _key(planes.shape[0], wq, scales),
    spec=lambda planes, wq, scales, gscale, *, OUT="f32", **_: _dense_product(
        _x_of(planes), wq, scales, gscale, TORCH_DTYPE_OF[OUT]),
    specialize=lambda planes, wq, scales, gscale: {
        **_specialize(wq, scales), "BLOCK_M": pow2_at_least(planes.shape[0]),
        "KW_DIV": pow2_dividing(wq.shape[1])})
def fp4_qmv(planes, wq, scales, global_scale, *, GROUP: kd.constexpr, E4M3: kd.constexpr,
            BLOCK_M: kd.constexpr, N_DIV: kd.constexpr, KW_DIV: kd.constexpr, OUT: kd.constexpr = "f32",
            BLOCK_N, BLOCK_KW, SPLIT_K, STAGES):
    """planes (M, 8, K/8) fp32 from qmv_prep, wq (N, K/8) words, scales (N, K/GROUP) uint8 codes,
    global_scale (1,) fp32 or None -> (M, N) in OUT (fp32 with split-K, whose partial sums add up)."""
    M = planes.shape[0]
    f = fp4_frame(wq, GROUP, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_KW=BLOCK_KW, SPLIT_K=SPLIT_K,
                  N_DIV=N_DIV, KW_DIV=KW_DIV, STAGES=STAGES)
    acc = kd.zeros((BLOCK_M, BLOCK_N), kd.f32)
    for wc, g, words, s in fp4_chunks(f, wq, scales, E4M3):
        values = [_e2m1(words, j) for j in kd.static_range(CODES_PER_WORD)]
        for m in f.rows(M):   # every row reuses the decoded values
            row = kd.sum(f.per_group(f.dot(values, planes, m, wc)) * s, axis=1)
            acc += gemv.into_row(row, m, BLOCK_M)
    return fp4_store(f, acc, global_scale, M, OUT, SPLIT_K)


def fp4_frame(wq, GROUP: int, **blocks) -> gemv.Frame:
    """The GEMV frame over fp4 words (8 codes each) in groups of GROUP codes."""
    return gemv.Frame(wq.shape[0], wq.shape[1], WPG=GROUP // CODES_PER_WORD, **blocks)


def fp4_chunks(f: gemv.Frame, wq, scales, E4M3: bool):
    """The frame's chunk loop: (word indices, group indices, words, fp32 group scales) per chunk.
    Words past K (or rows past N) read 0, which decodes to +0; their scales read code 0: finite."""
    for w0 in f.chunks():
        wc, g, words = f.chunk(wq, w0)
        yield wc, g, words, _group_scales(f.per_weight_row(scales, g), E4M3)


def fp4_store(f: gemv.Frame, acc, global_scale, M, OUT: str, SPLIT_K: int):
    """nvfp4's global scale applied to the fp32 sums, then the frame's store."""
    if global_scale is not None:
        acc *= _global_factor(global_scale, f.n)[None, :]
    return f.store(acc, M, f.N, OUT, SPLIT_K)


def run_fp4_qmv(x, wq, scales, global_scale=None, *, backend=None, config=None, prep_config=None):
    """x (M, K) -> (M, N) in x.dtype: the affine GEMV's activation prep, then the fp4 GEMV."""
    from kilnx.kernels.qmatmul import qmv_prep
    group = _group_of(wq, scales)
    # qmv_prep's group sums serve the affine bias term only; fp4 has none and ignores them
    planes, _ = qmv_prep(x, PER=CODES_PER_WORD, GROUP=group, backend=backend, config=prep_config)
    y = fp4_qmv(planes, wq, scales, global_scale, OUT=OUT_DTYPES.get(x.dtype, "f32"),
                backend=backend, config=config)
    return y if y.dtype == x.dtype else y.to(x.dtype)


# ---- fp4_qmm: tile GEMM with the decode in the prologue ---------------------------------------------
def _qmm_default(x, wq, scales, gscale, **_):
    """Few rows: the weight fills the MMA's wide side (what the affine qmm measured best on an H200;
    not yet measured for fp4)."""
    m = x.shape[0]
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "SWAP": True, "num_warps": 4, "num_stages": 4}
    if m <= 64:
        return {"BLOCK_M": max(16, pow2_at_least(m)), "BLOCK_N": 64, "BLOCK_K": 128, "SWAP": True,
                "num_warps": 4}
    return {}


@kd.kernel(
    tune={"BLOCK_M": kd.pow2(16, 256, default=128), "BLOCK_N": kd.pow2(16, 256, default=128),
          "BLOCK_K": kd.pow2(32, 256, default=64), "SWAP": kd.boolean(default=False),
          "num_warps": kd.choice(2, 4, 8, default=8), "num_stages": kd.choice(1, 2, 3, 4, default=3)},
    key=lambda x, wq, scales, gscale, **_: _key(x.shape[0], wq, scales),
    spec=lambda x, wq, scales, gscale, **_: _dense_product(x, wq, scales, gscale, x.dtype),
    default=_qmm_default,
    specialize=lambda x, wq, scales, gscale: {**_specialize(wq, scales), "K_DIV": pow2_dividing(x.shape[1])})
def fp4_qmm(x, wq, scales, global_scale, *, GROUP: kd.constexpr, E4M3: kd.constexpr, N_DIV: kd.constexpr,
            K_DIV: kd.constexpr, BLOCK_M, BLOCK_N, BLOCK_K, SWAP):
    """x (M, K), wq (N, K/8) words, scales (N, K/GROUP) uint8 codes, global_scale (1,) fp32 or None
    -> (M, N) in x.dtype."""
    M, K = x.shape
    N = wq.shape[0]
    N_IN = N_DIV % BLOCK_N == 0         # whole blocks along N and K: no masks there
    K_IN = K_DIV % BLOCK_K == 0
    NG = BLOCK_K // GROUP               # groups per K step (BLOCK_K >= 32 >= GROUP)
    pm, pn = kd.grid(kd.cdiv(M, BLOCK_M), kd.cdiv(N, BLOCK_N))
    rm = pm * BLOCK_M + kd.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + kd.arange(0, BLOCK_N)
    nibble = kd.arange(0, CODES_PER_WORD) * 4
    acc = kd.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), kd.f32)
    for k0 in kd.range(0, K, BLOCK_K):
        rk = k0 + kd.arange(0, BLOCK_K)
        # whole words along K (contiguous); nibble j of word w is element k = 8 w + j
        kw = k0 // CODES_PER_WORD + kd.arange(0, BLOCK_K // CODES_PER_WORD)
        words = kd.load(wq, rn[:, None], kw[None, :], check=(not N_IN, not K_IN))
        values = _e2m1(words[:, :, None] >> nibble[None, None, :])
        # one scale per row and group, broadcast over the group's values
        g = k0 // GROUP + kd.arange(0, NG)
        s = _group_scales(kd.load(scales, rn[:, None], g[None, :], check=(not N_IN, not K_IN)), E4M3)
        w = kd.reshape(kd.reshape(values, (BLOCK_N, NG, GROUP)) * s[:, :, None], (BLOCK_N, BLOCK_K))
        if SWAP:
            acc += kd.dot(w.to(x.dtype), kd.load(x, rm[None, :], rk[:, None], check=(True, not K_IN)))
        else:
            acc += kd.dot(kd.load(x, rm[:, None], rk[None, :], check=(True, not K_IN)), kd.trans(w).to(x.dtype))
    if global_scale is not None:
        # after the dot, so the 16-bit operands stay exact
        acc *= _global_factor(global_scale, rn)[:, None] if SWAP else _global_factor(global_scale, rn)[None, :]
    out = kd.output((M, N), x.dtype)
    if SWAP:
        kd.store(out, rm[None, :], rn[:, None], acc)
    else:
        kd.store(out, rm[:, None], rn[None, :], acc)
    return out


# ---- the public entry (called by kilnx.kernels.qmatmul.qmatmul) -------------------------------------
# Rows up to which the GEMV serves on the GPU: the affine kernels' measured crossover (H200), not yet
# measured for fp4. numba compiles the GEMV's per-row loop slowly, so on the CPU only single rows take it.
FP4_QMV_MAX_ROWS = 4


def fp4_qmatmul(x: torch.Tensor, w) -> torch.Tensor:
    """x (..., K) @ w.T for an mxfp4/nvfp4 QWeight (N, K) -> (..., N) in x.dtype."""
    if w.mode not in ("mxfp4", "nvfp4"):
        raise ValueError(f"fp4_qmatmul takes mxfp4/nvfp4 weights, not {w.mode!r}")
    lead, k = x.shape[:-1], x.shape[-1]
    if len(w.shape) != 2 or w.shape[-1] != k:
        raise ValueError(f"qmatmul: weight {w.shape} does not match x's last dim {k}")
    x2 = x.reshape(-1, k)
    n = w.shape[0]
    if x2.shape[0] == 0:
        return x.new_empty(*lead, n)
    gscale = None if w.global_scale is None else w.global_scale.reshape(1)
    args = (x2, w.packed, w.scales, gscale)
    max_rows = FP4_QMV_MAX_ROWS if x.is_cuda else 1
    if x2.shape[0] > max_rows:
        y = fp4_qmm(*args)
    elif x.is_cuda:   # two codes per fp16 instruction (fp4_qmv_h2.py); numba would emulate fp16 slowly
        from kilnx.kernels.fp4_qmv_h2 import run_fp4_qmv_h2
        y = run_fp4_qmv_h2(*args)
    else:
        y = run_fp4_qmv(*args)
    return y.reshape(*lead, n)


# ---- tuning: random words and plausible scale codes (quantizing real weights on the host is slow) -----
def make_fp4_args(problem: dict, device: str):
    m, n, k, mode = problem["M"], problem["N"], problem["K"], problem.get("mode", "mxfp4")
    spec = FP_MODES[mode]
    g = torch.Generator(device="cpu").manual_seed(m * 7919 + n * 31 + k + spec.group_size)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    wq = torch.randint(-2**31, 2**31 - 1, (n, k // CODES_PER_WORD), generator=g, dtype=torch.int64).to(torch.int32)
    # e8m0 codes 2^-8..2^-1, or positive normal e4m3 codes (exponent fields 1..8)
    lo, hi = (0x08, 0x48) if spec.e4m3_scale else (119, 127)
    scales = torch.randint(lo, hi, (n, k // spec.group_size), generator=g, dtype=torch.int32).to(torch.uint8)
    gscale = torch.tensor([NVFP4_GLOBAL_RANGE * 0.5]) if spec.e4m3_scale else None
    return tuple(None if t is None else t.to(device) for t in (x, wq, scales, gscale))


def make_fp4_qmv_args(problem: dict, device: str):
    x, wq, scales, gscale = make_fp4_args(problem, device)
    planes = x.float().reshape(x.shape[0], -1, CODES_PER_WORD).transpose(1, 2).contiguous()
    return planes, wq, scales, gscale


def _tolerance(args):
    """(rtol, atol) for a K-long dot of 16-bit operands: atol scales with sqrt(K) x rms(x) x max |w|."""
    x, wq, scales, gscale = args
    if x.dim() == 3:   # the GEMV's planes
        x = _x_of(x)
    wmax = dense_weight(wq, scales, gscale).abs().max().item()
    return 2e-2, 4e-3 * (x.shape[1] ** 0.5) * x.float().pow(2).mean().sqrt().item() * wmax


FP4_PROBLEMS = [{"N": 4096, "K": 4096, "mode": mode} for mode in ("mxfp4", "nvfp4")]
fp4_qmv.tuning(make_args=make_fp4_qmv_args, problems=[{"M": m, **p} for p in FP4_PROBLEMS for m in (1, 4)])
fp4_qmm.tuning(make_args=make_fp4_args, problems=[{"M": 512, **p} for p in FP4_PROBLEMS])
fp4_qmv.tolerance = _tolerance
fp4_qmm.tolerance = _tolerance
