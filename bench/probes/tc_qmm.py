"""Design probe (not a kilnx kernel; kernels/qmv_wg.py's qmm_wg is its DSL form): the 4-bit product for 1-4096
activation rows (16 a program up to 16 rows, the GEMV's sizes) with the weight dequantized straight into
wgmma's register operand, on tc_gemv.py's byte layout (the same packing: each (64 rows x 64 codes) block stored
in the order a warpgroup's threads hold the operand), GPI groups a K step, split over K or not.
Timed on the H200 in session 20 (bench/results README): flat in the rows up to 16, faster than qmv_h2 from 4
rows, slower at one; at 2048-4096 rows 1.56-1.85x cuBLAS against qmatmul's route's 1.10-1.17x.

Why: qmm at 512 rows stays at 1.8x cuBLAS bf16's time (dequantize to a bf16 copy, then the dense GEMM; the
copy costs ~0.6x cuBLAS's time), and the fused kernel (qmm PACKED: decode in the K loop) reached 2.2x: its
TTGIR stores the decoded 64 x 128 bf16 tile to shared memory and loads it back as the MMA operand every K
step. Here the weight goes from a 16-byte load per thread, through one asm (two byte permutes, four LOP3,
eight bf16x2 FMAs for 8 codes: 128 + q -> q exactly, then q * s + b rounded once, as MLX's dequantize to
bf16 would), to the operand registers. x (BM rows x 64) is the B operand, staged through shared memory by
Triton's pipeliner.

Compiled for sm_90 here (triton 3.6): the A operand stays in registers at 64 / 128 weight rows and 128 / 256
activation rows a program, and the pipelined loop (3 stages) stores nothing to shared memory itself; its SASS
is 180-239 instructions per 32 codes a thread (32 HFMA2, 26 PRMT, 16 LOP3, 4 HGMMA of m64n128k16 or
m64n256k16): ~190 issue cycles a K step of a warpgroup against ~256 (BM=128) or ~512 (BM=256) cycles of
its MMAs at the tensor cores' peak bf16 rate (computed, not measured), so the decode may hide under them.
The GPU decides.

  GPU run:   python bench/probes/tc_qmm.py [CSV]   (default $OUT/tc_qmm.csv; bench/device_run.sh tcqmm)
  CPU check: TRITON_INTERPRET=1 python -m pytest tests/kernels/test_tc_gemv_probe.py
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tc_gemv import BN, GS, INTERP, cli, compiled_facts, group_major, pack, write_rows  # noqa: E402
from kilnx.codegen.triton_rt import NIBBLE_DEQUANT_ASM  # noqa: E402 - the asm of kd.nibbles with a scale


@triton.jit
def _dequant(byt, s, b, ASM: tl.constexpr):
    """(low, high) codes of each byte dequantized to bf16 (q * s + b, one rounding), joined on a new last
    axis; s and b are each byte's row scale and bias (broadcast over the bytes)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(NIBBLE_DEQUANT_ASM, "=r,=r,=r,=r,r,r,r,r,r", [byt, s, b],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        sf, bf = s.to(tl.float32), b.to(tl.float32)
        lo = ((byt & 0xF).to(tl.float32) * sf + bf).to(tl.bfloat16)
        hi = ((byt >> 4).to(tl.float32) * sf + bf).to(tl.bfloat16)
    return tl.join(lo, hi)


@triton.jit
def tc_qmm_kernel(w_ptr, s_ptr, b_ptr, x_ptr, y_ptr, N, G, M, K, STEPS_PER_SPLIT,
                  WG: tl.constexpr, BM: tl.constexpr, ASM: tl.constexpr, UPCAST: tl.constexpr,
                  GPI: tl.constexpr, SPLIT: tl.constexpr):
    """GPI groups a K step (one load of GPI consecutive blocks, one dot of K = 64 GPI): the bytes in flight a
    program grow with GPI; the first GPU run (GPI 1) held ~2 KB a program in flight and waited ~0.7 us a step."""
    ROWS: tl.constexpr = 64 * WG
    pid, pm, pk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rr = tl.arange(0, ROWS)
    gi = tl.arange(0, GPI)
    mm = pm * BM + tl.arange(0, BM)
    kk = tl.arange(0, 64 * GPI)
    e = tl.arange(0, 2048 * WG * GPI)
    acc = tl.zeros((ROWS, BM), tl.float32)
    steps = G // GPI
    for step in range(pk * STEPS_PER_SPLIT, tl.minimum(pk * STEPS_PER_SPLIT + STEPS_PER_SPLIT, steps)):
        blk = pid * G + step * GPI
        byt = tl.load(w_ptr + blk * (2048 * WG) + e).reshape(GPI, 4 * WG, 8, 4, 8, 2).permute(1, 5, 2, 0, 4, 3)
        byt = byt.reshape(ROWS, GPI * 32)               # column: 32 group + byte column
        sb = (blk + gi[None, :]) * ROWS + rr[:, None]   # (ROWS, GPI)
        s = tl.broadcast_to(tl.load(s_ptr + sb)[:, :, None], (ROWS, GPI, 32)).reshape(ROWS, GPI * 32)
        b = tl.broadcast_to(tl.load(b_ptr + sb)[:, :, None], (ROWS, GPI, 32)).reshape(ROWS, GPI * 32)
        a = _dequant(byt, s, b, ASM).reshape(ROWS, 64 * GPI)
        x = tl.load(x_ptr + mm[:, None] * K + step * (64 * GPI) + kk[None, :], mask=mm[:, None] < M, other=0.0)
        if UPCAST:      # the CPU interpreter's dot mis-multiplies bf16 operands
            acc = tl.dot(a.to(tl.float32), tl.trans(x).to(tl.float32), acc)
        else:
            acc = tl.dot(a, tl.trans(x), acc)
    mask = mm[None, :] < M
    if SPLIT:
        tl.atomic_add(y_ptr + mm[None, :] * N + rows[:, None], acc, mask=mask, sem="relaxed")
    else:
        tl.store(y_ptr + mm[None, :] * N + rows[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


def tc_qmm(x: torch.Tensor, packed: torch.Tensor, s_g: torch.Tensor, b_g: torch.Tensor, *, block_m: int = 128,
           asm: bool | None = None, num_stages: int = 3, gpi: int = 1, split_k: int = 1) -> torch.Tensor:
    """x (M, K) bf16 times the packed weight (tc_gemv.pack): (M, N) bf16 (fp32 when split over K)."""
    p, g, block = packed.shape
    wg = block // (BN * GS // 2)
    m, k, n = x.shape[0], x.shape[1], p * BN * wg
    if g % gpi:
        raise ValueError(f"{g} groups do not divide into steps of {gpi}")
    split = split_k > 1
    y = (torch.zeros if split else torch.empty)(m, n, dtype=torch.float32 if split else x.dtype, device=x.device)
    per = -(-(g // gpi) // split_k)
    tc_qmm_kernel[(p, triton.cdiv(m, block_m), split_k)](packed, s_g, b_g, x, y, n, g, m, k, per, WG=wg,
                                                         BM=block_m, ASM=(not INTERP) if asm is None else asm,
                                                         UPCAST=INTERP, GPI=gpi, SPLIT=split,
                                                         num_warps=4 * wg, num_stages=num_stages)
    return y


def compile_report(wg: int = 2, block_m: int = 128, num_stages: int = 3, asm: bool = True, gpi: int = 1) -> dict:
    """tc_qmm_kernel compiled for sm_90 (tc_gemv.compiled_facts)."""
    sig = {"w_ptr": "*u8", "s_ptr": "*bf16", "b_ptr": "*bf16", "x_ptr": "*bf16", "y_ptr": "*bf16",
           "N": "i32", "G": "i32", "M": "i32", "K": "i32", "STEPS_PER_SPLIT": "i32"}
    return compiled_facts(tc_qmm_kernel, sig, {"WG": wg, "BM": block_m, "ASM": asm, "UPCAST": False, "GPI": gpi,
                                               "SPLIT": False}, num_warps=4 * wg, num_stages=num_stages)


def gemv_rows(smoke: bool) -> list[dict]:
    """1-16 activation rows (BM 16): GPI x split x stages against qmv_h2's path (prep + GEMV) and cuBLAS bf16,
    over rotating weight copies (more bytes than L2 holds), as tc_gemv.py times its kernel."""
    import itertools
    from bench_kernels import copies_for, copy_gbps, time_calls
    from kilnx.kernels import qmv_h2 as H
    from kilnx.kernels import qmv_wg as W
    from kilnx.kernels.qmatmul import dequantize_on_device, make_qmatmul_args
    dev = torch.device("cpu" if smoke else "cuda")
    copy = copy_gbps(smoke)
    shapes = {"tiny": (128, 512)} if smoke else {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                                 "down": (4096, 14336)}
    configs = [(2, 1, 1), (4, 2, 1)] if smoke else list(itertools.product((2, 4, 8), (1, 2, 4, 8), (1, 3)))
    rows = []
    for name, (n, k) in shapes.items():
        nbytes = n * k // 2 + 2 * 2 * n * k // GS
        weights = []
        for _ in range(copies_for(nbytes, smoke)):
            _, wq, s, b = make_qmatmul_args({"M": 1, "N": n, "K": k, "bits": 4, "gs": GS}, str(dev))
            weights.append((wq, s, b, (pack(wq, 1), group_major(s, 1), group_major(b, 1))))
        dense = dequantize_on_device(*weights[0][:3], 4, GS).bfloat16()
        for m in (1, 5) if smoke else (1, 4, 16):
            x = torch.randn(m, k, device=dev).bfloat16()
            ref = x.float() @ dense.float().t()
            us_cublas = 1e6 * time_calls(lambda: x @ dense.t(), [()])     # one copy: its bf16 weight is 4x the bytes
            us_h2 = 1e6 * time_calls(lambda a, bq, c: H.run_qmv_h2(x, a, bq, c), [w[:3] for w in weights])
            dsl = {"BLOCK_M": 16, "GPI": 2 if smoke else 8, "SPLIT_K": 4, "num_stages": 1 if smoke else 3}
            us_dsl = 1e6 * time_calls(lambda p_, s_, b_: W.qmm_wg(x, W.flat(p_), s_, b_, config=dsl),
                                      [w[3] for w in weights])
            for gpi, split, st in configs:
                kw = {"block_m": 16, "gpi": gpi, "split_k": split, "num_stages": st, "asm": None if not smoke else False}
                y = tc_qmm(x, *weights[0][3], **kw)
                err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                us = 1e6 * time_calls(lambda p_, s_, b_: tc_qmm(x, p_, s_, b_, **kw), [w[3] for w in weights])
                rows.append({"case": f"tc_gemv_b4_M{m}_{name}", "wg": 1, "block_m": 16, "stages": st, "gpi": gpi,
                             "split_k": split, "us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1),
                             "pct_copy": round(100 * nbytes / us / 1e3 / copy, 1), "ratio_vs_cublas_time":
                             round(us / us_cublas, 3), "us_cublas_bf16": round(us_cublas, 2),
                             "us_qmv_h2_path": round(us_h2, 2), "us_kilnx_qmm_wg_gpi8_split4": round(us_dsl, 2),
                             "rel_err": f"{err:.2e}"})
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    """llama-3.1-8b's four projections at 128-4096 rows: the probe over (warpgroups, BM, stages) against
    cuBLAS bf16 on the dequantized weight and kilnx's qmatmul route, one run, CUDA-graph replayed."""
    smoke, path = cli("tc_qmm.csv")
    from bench_kernels import time_calls          # the bench's own protocol
    from kilnx import ops
    from kilnx.kernels import qmv_wg as W
    from kilnx.kernels.qmatmul import dequantize_on_device, make_qmatmul_args
    from kilnx.quant import QWeight
    dev = torch.device("cpu" if smoke else "cuda")
    shapes = {"tiny": (128, 128)} if smoke else {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                                 "down": (4096, 14336)}
    configs = [(1, 64, 1, False, 2), (2, 64, 1, False, 1)] if smoke else \
        [(wg, bm, st, True, gpi) for wg, bm, st, gpi in [(1, 128, 3, 1), (2, 128, 3, 1), (2, 128, 4, 1), (1, 256, 3, 1),
                                                          (2, 256, 3, 1), (2, 256, 2, 1), (2, 64, 3, 1), (1, 128, 3, 2),
                                                          (2, 128, 3, 2), (2, 256, 2, 2), (1, 64, 3, 4)]] + \
        [(2, 128, 3, False, 1)]
    rows = gemv_rows(smoke)
    for name, (n, k) in shapes.items():
        _, wq, s, b = make_qmatmul_args({"M": 1, "N": n, "K": k, "bits": 4, "gs": GS}, str(dev))   # random words
        qw = QWeight.from_mlx(wq, s, b, bits=4, group_size=GS)
        dense = dequantize_on_device(wq, s, b, 4, GS).bfloat16()
        packs = {wg: (pack(wq, wg), group_major(s, wg), group_major(b, wg)) for wg in (1, 2)}
        for m in (64, 100) if smoke else (128, 512, 2048, 4096):
            x = torch.randn(m, k, device=dev).bfloat16()
            ref = x.float() @ dense.float().t()
            us_cublas = 1e6 * time_calls(lambda: x @ dense.t(), [()])
            us_route = 1e6 * time_calls(lambda: ops.qmatmul(x, qw), [()])
            us_wg = 1e6 * time_calls(lambda: W.qmm_wg(x, W.flat(packs[1][0]), *packs[1][1:],
                                                      config={"BLOCK_M": 64 if smoke else 128}), [()])
            for wg, bm, st, asm, gpi in configs:
                def call():
                    return tc_qmm(x, *packs[wg], block_m=bm, asm=asm, num_stages=st, gpi=gpi)
                try:
                    y = call()
                    err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                    us = 1e6 * time_calls(call, [()])
                except Exception as exc:  # noqa: BLE001 - a config the GPU rejects (shared memory) is a row too
                    err, us = float("nan"), float("nan")
                    print(f"{name} M={m} {(wg, bm, st, asm, gpi)}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                rows.append({"case": f"tc_qmm_b4_M{m}_{name}", "wg": wg, "block_m": bm, "stages": st, "gpi": gpi,
                             "split_k": 1, "asm": asm,
                             "us": round(us, 2), "ratio_vs_cublas_time": round(us / us_cublas, 3),
                             "us_cublas_bf16": round(us_cublas, 2), "us_kilnx_qmatmul": round(us_route, 2),
                             "us_kilnx_qmm_wg_bm128": round(us_wg, 2),
                             "tflops": round(2 * m * n * k / us / 1e6, 1), "rel_err": f"{err:.2e}"})
                print(rows[-1], flush=True)
    write_rows(path, rows, smoke)

if __name__ == "__main__":
    main()
