"""qmatmul for MLX's fp4 formats (mxfp4, nvfp4) = mx.quantized_matmul, through each backend.

Weights come from `mx.quantize`; kilnx's fp4 GEMV and tile GEMM must give MLX's product. Shapes are
chosen so no block divides N or K (K stays a multiple of the group), to exercise every bounds mask.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import kilnx.dsl as kd
from kilnx.kernels import qmatmul as Q
from kilnx.kernels import qmatmul_fp4 as F
from kilnx.quant import QWeight
from kilnx.quant.float_codecs import E2M1_VALUES, E4M3_VALUES

mx = pytest.importorskip("mlx.core")
interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")
# K = 96: 3 mxfp4 / 6 nvfp4 groups in 12 words, not a multiple of the 8-word GEMV chunk nor of the
# GEMM's BLOCK_K (MLX's nvfp4 quantize wants K % 32 == 0); N = 37 is not a multiple of any BLOCK_N
SHAPE_K = {"mxfp4": 96, "nvfp4": 96}
N = 37
QMV_CONFIG = {"BLOCK_N": 16, "BLOCK_KW": 8}


def mlx_case(mode, m, n, k, seed, global_scale=None):
    """(x, QWeight, MLX's x @ w.T): quantized_matmul, or with a global scale (which quantized_matmul
    does not take) MLX's own float32 dequantization times x in float64."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    gs = {} if global_scale is None else {"global_scale": mx.array(np.float32(global_scale))}
    wq, s = mx.quantize(mx.array(w), mode=mode, **gs)[:2]
    if global_scale is None:
        want = np.array(mx.quantized_matmul(mx.array(x), wq, s, transpose=True, mode=mode))
    else:
        dense = np.array(mx.dequantize(wq, s, mode=mode, dtype=mx.float32, **gs)).astype(np.float64)
        want = (x.astype(np.float64) @ dense.T).astype(np.float32)
    qw = QWeight.from_mlx(np.array(wq), np.array(s), mode=mode,
                          global_scale=None if global_scale is None else np.float32([global_scale]))
    return torch.from_numpy(x), qw, torch.from_numpy(want)


def kernel_args(x, qw):
    gscale = None if qw.global_scale is None else qw.global_scale.reshape(1)
    return x, qw.packed, qw.scales, gscale


def check(got, want, k):
    # fp32 accumulation in another order than MLX's: a few ulps of the K-long sum
    tol = 1e-4 * (k ** 0.5) * float(want.abs().max()) + 1e-5
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    assert (got.double() - want.double()).abs().max().item() <= tol


@interpreter_only
@pytest.mark.parametrize("m", [1, 2, 17])
@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_gemv_and_gemm_match_mlx_on_the_interpreter(mode, m):
    k = SHAPE_K[mode]
    x, qw, want = mlx_case(mode, m, N, k, seed=m)
    args = kernel_args(x, qw)
    check(F.run_fp4_qmv(*args, backend="triton", config=QMV_CONFIG), want, k)
    # the swapped operand order (weight on the MMA's wide side) for the few-row case
    qmm_config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64 if mode == "mxfp4" else 32, "SWAP": m < 16}
    check(F.fp4_qmm(*args, backend="triton", config=qmm_config), want, k)


@interpreter_only
@pytest.mark.parametrize("swap", [False, True])
def test_nvfp4_global_scale_and_split_k(swap):
    x, qw, want = mlx_case("nvfp4", 3, N, 160, seed=4, global_scale=37.5)
    args = kernel_args(x, qw)
    # split-K: programs add fp32 partial sums with atomics; chunks never cross a split boundary
    check(F.run_fp4_qmv(*args, backend="triton", config={**QMV_CONFIG, "SPLIT_K": 2}), want, 160)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SWAP": swap}
    check(F.fp4_qmm(*args, backend="triton", config=cfg), want, 160)


@pytest.mark.parametrize("mode,global_scale", [("mxfp4", None), ("nvfp4", None), ("nvfp4", 5.0)])
def test_reference_interpreter_matches_mlx(mode, global_scale):
    k = SHAPE_K[mode]
    x, qw, want = mlx_case(mode, 2, N, k, seed=5, global_scale=global_scale)
    args = kernel_args(x, qw)
    check(F.run_fp4_qmv(*args, backend="reference", config=QMV_CONFIG), want, k)
    check(F.fp4_qmm(*args, backend="reference", config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}), want, k)


def test_numba_matches_mlx():
    x, qw, want = mlx_case("nvfp4", 3, N, 96, seed=6, global_scale=2.0)
    got = F.fp4_qmm(*kernel_args(x, qw), backend="numba", config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64})
    check(got, want, 96)


@kd.kernel
def decode_every_code(words, scale_codes, *, E4M3: kd.constexpr):
    """Each nibble position of 16 words (every e2m1 code) and 256 scale codes, decoded."""
    kd.grid(1)
    w = kd.arange(0, 16)
    words_t = kd.load(words, w)
    values = kd.output((128,), kd.f32, name="values")
    for j in kd.static_range(8):
        kd.store(values, w * 8 + j, F._e2m1(words_t, j))
    c = kd.arange(0, 256)
    scales = kd.output((256,), kd.f32, name="scales")
    kd.store(scales, c, F._group_scales(kd.load(scale_codes, c), E4M3))
    return values, scales


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=interpreter_only), "reference"])
@pytest.mark.parametrize("e4m3", [False, True])
def test_every_code_decodes_bit_exactly(backend, e4m3):
    """All 16 e2m1 codes at all 8 nibble positions (signed zero and the subnormal 0.5 included), all
    256 e8m0 exponents (2^-127 and inf at the ends) and all 256 e4m3 codes (subnormals, NaN)."""
    rng = np.random.default_rng(0)
    codes = rng.permuted(np.tile(np.arange(16, dtype=np.uint32), 8).reshape(8, 16), axis=1).T  # (word, nibble)
    words = np.bitwise_or.reduce(codes << (4 * np.arange(8, dtype=np.uint32)), axis=1).astype(np.uint32)
    values, scales = decode_every_code(torch.from_numpy(words.view(np.int32)),
                                       torch.arange(256, dtype=torch.int32).to(torch.uint8),
                                       E4M3=e4m3, backend=backend)
    assert np.array_equal(values.numpy().view(np.uint32), E2M1_VALUES[codes.reshape(-1)].view(np.uint32))
    with np.errstate(over="ignore"):
        want = E4M3_VALUES if e4m3 else np.ldexp(1.0, np.arange(256) - 127).astype(np.float32)
    np.testing.assert_array_equal(scales.numpy(), want)   # NaN where the table has NaN


@interpreter_only
@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_public_op_serves_fp4_weights_with_leading_dims(mode):
    k = SHAPE_K[mode]
    for m in (1, 3):   # on the CPU one row takes the GEMV, more the GEMM
        x, qw, want = mlx_case(mode, m, N, k, seed=10 + m)
        check(Q.qmatmul(x.reshape(m, 1, k), qw).reshape(m, N), want, k)
    assert Q.qmatmul(torch.zeros(0, k), qw).shape == (0, N)


def test_bf16_activations_give_bf16_results():
    x, qw, want = mlx_case("mxfp4", 2, N, 96, seed=12)
    y = F.fp4_qmm(*kernel_args(x.bfloat16(), qw), backend="reference")
    assert y.dtype == torch.bfloat16
    # x rounded to bf16 (2^-9 relative) dominates; the decoded weights are exact in bf16
    assert (y.double() - want.double()).abs().max().item() <= 2e-2 * float(want.abs().max())


AOT_CASES = """
import torch
from kilnx.codegen.aot import compile_for_target
from kilnx.kernels import qmatmul_fp4 as F
from kilnx.quant import QWeight
x = torch.randn(4, 256).bfloat16()
planes = x.float().reshape(4, -1, 8).transpose(1, 2).contiguous()
for mode, gscale, swap in (("mxfp4", None, True), ("nvfp4", torch.tensor([3.0]), False)):
    w = QWeight.quantize(torch.randn(64, 256), mode=mode)
    args = (w.packed, w.scales, gscale)
    k = compile_for_target(F.fp4_qmm, (x, *args), {"SWAP": swap, "BLOCK_M": 16 if swap else 64,
                                                   "BLOCK_N": 64, "BLOCK_K": 128}, aligned=True)
    assert "mma" in k.asm["ptx"], "fp4_qmm's dot did not lower to tensor-core instructions"
    k1 = compile_for_target(F.fp4_qmv, (planes[:1], *args), {}, kw={"OUT": "bf16"}, aligned=True)
    # the e2m1 decode reads 0.5 as an fp32 subnormal: flushing it to zero would lose every +-0.5
    assert "ftz" not in k.asm["ptx"] + k1.asm["ptx"], "fp32 subnormals are flushed"
    compile_for_target(F.fp4_qmv, (planes, *args), {"SPLIT_K": 2, "BLOCK_KW": 64})
    from kilnx.kernels import fp4_qmv_h2 as F2
    from kilnx.kernels.qmv_h2 import _prep_spec
    p2, _, xs = _prep_spec(x.float(), PER=8, GROUP=w.group_size, BIAS=F2.X_BIAS)
    for rows, cfg in ((1, {"STAGES": 3}), (4, {"SPLIT_K": 2, "BLOCK_KW": 64, "STAGES": 2})):
        k2 = compile_for_target(F2.fp4_qmv_h2, (p2[:rows], xs[:rows], *args), cfg, kw={"OUT": "bf16"}, aligned=True)
        assert k2.asm["ptx"].count("fma.rn.f16x2") >= 4 and "cp.async" in k2.asm["ptx"]
print("ok")
"""


def test_fp4_kernels_compile_for_sm90():
    """The interpreter accepts programs the compiler rejects: compile the GPU source of each variant
    (both scale formats, swapped or not, one or several rows, split-K, global scale) for sm_90."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", AOT_CASES], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]


@pytest.mark.parametrize("kernel", [F.fp4_qmv, F.fp4_qmm])
def test_tuner_inputs_meet_the_spec_within_the_tuners_tolerance(kernel):
    """What the tuner's gate checks on each config: the kernel on make_args agrees with its spec."""
    args = kernel.make_args({"M": 2, "N": 24, "K": 128, "mode": "nvfp4"}, "cpu")
    got = kernel.compile(kernel.default_config(*args), *args, backend="reference")(*args)
    want = kernel.reference(*args)
    rtol, atol = kernel.tolerance(args)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


# ---- fp4_qmv_h2: two codes per fp16 instruction (the GPU's fp4 GEMV) -------------------------------
@pytest.mark.parametrize("backend", [pytest.param("triton", marks=interpreter_only), "reference"])
def test_fp16_pairs_hold_every_code_times_2_to_the_minus_14(backend):
    """All 16 codes at all 8 nibble positions: pair p's halves are codes p and p + 4, each exactly
    e2m1(code) * 2^-14 as fp16 (signed zero and the subnormal 0.5 * 2^-14 included)."""
    from kilnx.kernels import fp4_qmv_h2 as F2

    @kd.kernel
    def pairs_of(words):
        kd.grid(1)
        w = kd.arange(0, 16)
        words_t = kd.load(words, w)
        out = kd.output((16, 4), kd.u32, name="pairs")
        for p in kd.static_range(4):
            kd.store(out, w, p, F2.fp16_pair(words_t, p))
        return out

    rng = np.random.default_rng(1)
    codes = rng.permuted(np.tile(np.arange(16, dtype=np.uint32), 8).reshape(8, 16), axis=1).T
    words = np.bitwise_or.reduce(codes << (4 * np.arange(8, dtype=np.uint32)), axis=1).astype(np.uint32)
    got = pairs_of(torch.from_numpy(words.view(np.int32)), backend=backend).numpy().view(np.uint32)
    halves = np.stack([got & 0xFFFF, got >> 16], axis=-1).astype(np.uint16).view(np.float16)   # (16, 4, 2)
    want = E2M1_VALUES[codes].reshape(16, 2, 4).transpose(0, 2, 1) * np.float32(2.0 ** -14)
    assert np.array_equal(halves.astype(np.float32).view(np.uint32), want.astype(np.float16).astype(np.float32).view(np.uint32))
    assert np.array_equal(halves.astype(np.float32), want)                     # exact: no rounding


@interpreter_only
@pytest.mark.parametrize("m,x_scale", [(1, 1.0), (3, 1e-3), (2, 3e4)])
@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_fp4_qmv_h2_matches_mlx(mode, m, x_scale):
    """Any activation range: x is scaled per group to |x'| < 2^14 before the fp16 products."""
    from kilnx.kernels import fp4_qmv_h2 as F2
    k = SHAPE_K[mode]
    x, qw, want = mlx_case(mode, m, N, k, seed=20 + m)
    x, want = x * x_scale, want * x_scale
    for cfg in (QMV_CONFIG, {"BLOCK_N": 8, "BLOCK_KW": 8, "STAGES": 2, "SPLIT_K": 2},
                {**QMV_CONFIG, "CHAIN": 2}, {**QMV_CONFIG, "CHAIN": 4}):
        got = F2.run_fp4_qmv_h2(*kernel_args(x, qw), backend="triton", config=cfg)
        # fp16 products and 4-term fp16 sums (CHAIN: 4 * CHAIN terms): relative 2^-11 of each partial sum
        tol = 2e-3 * (k ** 0.5) * float(want.abs().max()) + 1e-6 * x_scale
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert (got.double() - want.double()).abs().max().item() <= tol


@interpreter_only
def test_fp4_qmv_h2_with_nvfp4_global_scale_on_numba():
    from kilnx.kernels import fp4_qmv_h2 as F2
    x, qw, want = mlx_case("nvfp4", 1, N, 160, seed=4, global_scale=37.5)
    got = F2.run_fp4_qmv_h2(*kernel_args(x, qw), backend="numba", config=QMV_CONFIG)
    assert (got.double() - want.double()).abs().max().item() <= 2e-3 * (160 ** 0.5) * float(want.abs().max())
