"""The dense GEMM x (M, K) @ w (N, K).T in the DSL: the second kernel of qmatmul's two-kernel path (the
weight dequantized once to 16 bits, then multiplied at the tensor cores' rate), for prompts of hundreds
of rows and for grids the fused qmm would starve (kernels/routing.py)."""

from __future__ import annotations

import torch

import kilnx.dsl as kd
from kilnx.kernels.sizes import pow2_at_least, pow2_dividing


def _mm_default(x, w, **_):
    """Best of 14 configs on the H200 for llama-3.1-8b gate_up (bench/results/2026-12-04_h200_quant_s14_mm.csv):
    persistent, one program per SM, at both sizes: M=4096 0.93x cuBLAS's time (the best 2-d grid 1.02x, a
    256 x 128 tile), M=512 1.13x (the best 2-d grid 1.25x)."""
    if x.element_size() == 4 and x.shape[0] >= 256:
        # fp32 operands (nemotron-3's router): these tiles asked 320-416 KB of shared memory of an H100's 227 KB
        # (its GPU test, session 30); 128 x 128 with K steps of 32 asks 160 KB (test_library_gpu_compile). Untimed.
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 4, "num_stages": 4, "PERSISTENT": True}
    if x.shape[0] >= 2048:
        return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "PERSISTENT": True}
    if x.shape[0] >= 256:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4, "PERSISTENT": True}
    return {}


def tma_ready(*tensors) -> bool:
    """Whether kd.load_tile may read these tensors (the launcher's rule), on a GPU or Triton's interpreter:
    such inputs take the TMA path, others kd.load."""
    from kilnx.codegen.launch import interpreting, tma_readable
    return all((t.is_cuda or interpreting()) and tma_readable(t) for t in tensors)


def sm_count(t: torch.Tensor) -> int:
    """Programs a persistent kernel launches: one per SM (4 off the GPU, where only the interpreter runs it)."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 4


@kd.kernel(
    tune={"BLOCK_M": kd.pow2(16, 256, default=64), "BLOCK_N": kd.pow2(16, 256, default=64),
          "BLOCK_K": kd.pow2(16, 256, default=64), "num_warps": kd.choice(2, 4, 8, default=4),
          "num_stages": kd.choice(1, 2, 3, 4, default=3), "TMA": kd.boolean(default=True),
          "PERSISTENT": kd.boolean(default=False)},
    key=lambda x, w, **_: {"M": x.shape[0], "N": w.shape[0], "K": x.shape[1]}, default=_mm_default,
    spec=lambda x, w, **_: (x.double() @ w.double().T).to(x.dtype),
    specialize=lambda x, w: {"M_DIV": pow2_dividing(x.shape[0]), "N_DIV": pow2_dividing(w.shape[0]),
                             "K_DIV": pow2_dividing(x.shape[1]),
                             "TMA_READY": tma_ready(x, w), "PROGRAMS": sm_count(x)})
def mm(x, w, *, M_DIV: kd.constexpr, N_DIV: kd.constexpr, K_DIV: kd.constexpr, TMA_READY: kd.constexpr,
       PROGRAMS: kd.constexpr, BLOCK_M, BLOCK_N, BLOCK_K, TMA, PERSISTENT):
    """x (M, K) @ w (N, K).T. PERSISTENT: one program per SM walks the output tiles (M-block fastest, as
    the 2-d grid orders them), its tile loop and K loop pipelined as one, so a tile's first loads are in
    flight while the previous tile's accumulator is stored."""
    M, K = x.shape
    N = w.shape[0]
    # dims the blocks divide need no bounds masks (unmasked tiles load and pipeline better)
    M_IN, N_IN, K_IN = M_DIV % BLOCK_M == 0, N_DIV % BLOCK_N == 0, K_DIV % BLOCK_K == 0
    out = kd.output((M, N), x.dtype)
    tiles_m = kd.cdiv(M, BLOCK_M)
    # the program's tiles: the one its 2-d grid position names, or every PROGRAMS-th from its id
    tiles = kd.range(kd.grid(PROGRAMS), tiles_m * kd.cdiv(N, BLOCK_N), PROGRAMS, flatten=True) if PERSISTENT \
        else [kd.grid(tiles_m, kd.cdiv(N, BLOCK_N))]
    for tile in tiles:
        pm, pn = (tile % tiles_m, tile // tiles_m) if PERSISTENT else tile
        rm = pm * BLOCK_M + kd.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + kd.arange(0, BLOCK_N)
        acc = kd.zeros((BLOCK_M, BLOCK_N), kd.f32)
        for k0 in kd.range(0, K, BLOCK_K):
            if TMA and TMA_READY and w.dtype == x.dtype:
                # boxes by TMA: no per-thread addresses, and the pipeliner waits on barriers, not on lanes
                a = kd.load_tile(x, pm * BLOCK_M, k0, shape=(BLOCK_M, BLOCK_K))
                b = kd.trans(kd.load_tile(w, pn * BLOCK_N, k0, shape=(BLOCK_N, BLOCK_K)))
            else:
                rk = k0 + kd.arange(0, BLOCK_K)
                a = kd.load(x, rm[:, None], rk[None, :], check=(not M_IN, not K_IN))
                b = kd.load(w, rn[None, :], rk[:, None], check=(not N_IN, not K_IN)).to(x.dtype)
            acc += kd.dot(a, b)
        kd.store(out, rm[:, None], rn[None, :], acc)
    return out


def dot_tolerance(x, wmax: float):
    xrms = x.float().pow(2).mean().sqrt().item()
    return 2e-2, 4e-3 * (x.shape[1] ** 0.5) * xrms * wmax


# The dense GEMM of the two-kernel path (what qmatmul runs on the GPU from 320 rows, and above 128 wherever
# 128-wide fused tiles would starve the grid: kernels/routing.py), tuned on the bf16 weight's shape with
# cuBLAS as its peer.
def make_mm_args(problem: dict, device: str):
    m, n, k = problem["M"], problem["N"], problem["K"]
    g = torch.Generator(device="cpu").manual_seed(m * 7919 + n * 31 + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16).to(device)
    return x, w


mm.tuning(make_args=make_mm_args, problems=[{"M": 2048, "N": 4096, "K": 4096}], peer=lambda x, w: x @ w.T)
mm.tolerance = lambda args: dot_tolerance(args[0], args[1].float().abs().max().item())
# the defaults and the best tiles of the session-14 sweep (bench/results/2026-12-04_h200_quant_s14_mm.csv)
mm.seed_configs = lambda problem: [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "num_warps": nw, "num_stages": ns, "TMA": True, "PERSISTENT": p}
    for bm, bn, nw, ns, p in [(128, 256, 8, 3, True), (128, 128, 4, 4, True), (128, 256, 8, 4, True),
                              (256, 128, 8, 3, False), (128, 128, 8, 4, True)]]


# ---- dense_gemv: a few rows against an unquantized weight ----------------------------------------------
def _gemv_default(x, w, *, ROWS, **_):
    """A program per weight row where the rows are few (nemotron-3's router: 128 of them), 4 rows otherwise, and
    K chunks up to 2048 and ~8k products a program: the tuner's best for the router at one and four rows on the
    H100 took 2048-long chunks, 6.5 / 7.3 us against 7.1 / 8.0 with 1024
    (bench/results/2026-12-06_h100_tune_nemotron3_decode_s30.csv). mm's tiles at one row gave that GEMV
    (1 x 2688 @ 2688 x 128, fp32) 2 programs, each walking K alone: 21 us a call, 0.49 ms of a 3.5 ms nemotron-3
    decode step on the H100 (session 30)."""
    bn = 1 if w.shape[0] < 1024 else 4
    return {"BLOCK_N": bn, "BLOCK_K": max(32, min(2048, pow2_at_least(x.shape[1]), 8192 // (ROWS * bn))),
            "num_warps": 4}


@kd.kernel(
    tune={"BLOCK_N": kd.pow2(1, 32, default=4), "BLOCK_K": kd.pow2(32, 2048, default=256),
          "num_warps": kd.choice(1, 2, 4, 8, default=4), "num_stages": kd.choice(1, 2, 3, default=2)},
    key=lambda x, w, **_: {"M": x.shape[0], "N": w.shape[0], "K": x.shape[1]}, default=_gemv_default,
    spec=lambda x, w, **_: (x.double() @ w.double().T).to(x.dtype),
    specialize=lambda x, w: {"ROWS": pow2_at_least(x.shape[0]), "K_DIV": pow2_dividing(x.shape[1])})
def dense_gemv(x, w, *, ROWS: kd.constexpr, K_DIV: kd.constexpr, BLOCK_N, BLOCK_K):
    """x (M, K) @ w (N, K).T for M up to DENSE_GEMV_MAX_ROWS, in x.dtype: BLOCK_N weight rows a program, each
    K chunk multiplied by all of x's rows (a broadcast product summed over K: tl.dot wants 16 rows)."""
    M, K = x.shape
    N = w.shape[0]
    n = kd.grid(kd.cdiv(N, BLOCK_N)) * BLOCK_N + kd.arange(0, BLOCK_N)
    m = kd.arange(0, ROWS)
    k_masked = K_DIV % BLOCK_K != 0
    acc = kd.zeros((ROWS, BLOCK_N), kd.f32)
    for k0 in kd.range(0, K, BLOCK_K):
        k = k0 + kd.arange(0, BLOCK_K)
        wt = kd.load(w, n[:, None], k[None, :], check=(True, k_masked)).f32()
        xt = kd.load(x, m[:, None], k[None, :], check=(True, k_masked)).f32()
        acc += kd.sum(xt[:, None, :] * wt[None, :, :], axis=2)
    out = kd.output((M, N), x.dtype)
    kd.store(out, m[:, None], n[None, :], acc)
    return out


DENSE_GEMV_MAX_ROWS = 16


def takes_dense_gemv(x) -> bool:
    """Whether qmatmul multiplies x (rows, K) by a dense weight with `dense_gemv` rather than `mm`: few rows, on the
    GPU (on the CPU numba's mm serves them as before: not measured against this there)."""
    return x.is_cuda and 0 < x.shape[0] <= DENSE_GEMV_MAX_ROWS


def make_gemv_args(problem: dict, device: str):
    m, n, k = problem["M"], problem["N"], problem["K"]
    g = torch.Generator(device="cpu").manual_seed(m * 7919 + n * 31 + k)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[problem.get("dtype", "bf16")]
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    return x, (torch.randn(n, k, generator=g) * 0.02).to(dtype).to(device)


dense_gemv.tuning(make_args=make_gemv_args, problems=[{"M": 1, "N": 128, "K": 2688, "dtype": "f32"}],
                  peer=lambda x, w: x @ w.T)
dense_gemv.tolerance = lambda args: dot_tolerance(args[0], args[1].float().abs().max().item())
