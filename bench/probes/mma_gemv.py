"""Design probe (a DSL kernel, not yet a library one): the 4-bit group-64 product for 1-16 rows on mma.sync, with
one or two warps a program and the weight decoded straight into the MMA's register operand, against qmatmul's
route and qmm_wg on llama-3.1-8b's four projections.

Why: the wgmma kernels (kernels/qmv_wg.py, wg_direct.py) are flat in the rows but latency-bound with few
warps an SM (448 one-warpgroup programs on gate_up, ~20% occupancy, session 25's ncu), and lose to qmv_h2 at
one row by a fixed ~9 us floor on qkv and o. mma.sync needs 16 weight rows a warp, not 64 a warpgroup, so a
program can be one warp. Compiled for sm_90 (Triton 3.6 here, on the CPU), the kd.dot of a 16-row tile takes
the decoded weight as a register operand (`dot_op<{opIdx = 0, parent = #mma, kWidth = 4}>`, no convert) when
the bytes are packed for kWidth 4 (`pack_kw4`); with qmm_wg's kWidth-2 packing the loop spent 208 PRMT on
moving halves. The main loop then has 32 HMMA and ~570 instructions a thread per 4 groups (~4.5 per code;
qmm_wg 3.8, qmv_h2 ~3.3 at one row) and no shared-memory store (at 2 groups a step ~4.7, and the scales take
an LDG + STS pair); x is staged per program (16 rows x 64 GPI codes, two bytes each), so few groups a step
and two stages keep the shared memory per warp small. Not run on a GPU yet (session 26 was
lent none): whether the occupancy outweighs the instructions is what this measures.

    GPU:  python bench/probes/mma_gemv.py OUT_CSV [rounds]
Timing: bench_kernels.time_calls (a CUDA graph over input copies that exceed L2, median of replays).
"""
from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_kernels import copies_for, time_paths, write_probe_csv  # noqa: E402

import kilnx.dsl as kd  # noqa: E402
from kilnx.kernels import qmatmul  # noqa: E402
from kilnx.kernels import qmv_wg as W  # noqa: E402
from kilnx.quant import QWeight  # noqa: E402

GS = 64


def pack_kw4(wq):
    """MLX 4-bit words (N, K/8) -> (N/64, K/64 * 2048) bytes for mma.sync's A operand at Triton's kWidth 4:
    byte (warp, lane, o = 4 i + 2 j + o0) holds row 16 warp + 8 o0 + lane // 4, byte column 8 i + 2 (lane % 4) + j."""
    q = W.codes_of(wq)
    n, k = q.shape
    q = q.reshape(n // 64, 4, 2, 8, k // 64, 4, 4, 2, 2)
    byte = q[..., 0] | (q[..., 1] << 4)          # (P, warp, o0, lane_hi, G, i, lane_lo, j)
    return byte.permute(0, 4, 1, 3, 6, 5, 7, 2).reshape(n // 64, -1).contiguous()


def dequant_kw4(wb, s_g, b_g):
    """pack_kw4's meaning: (N, K) fp32, q * s + b (scales and biases as qmv_wg.group_major makes them)."""
    p, g, _ = s_g.shape
    byte = wb.reshape(p, g, 4, 8, 4, 4, 2, 2).permute(0, 2, 7, 3, 1, 5, 4, 6)   # (P, warp, o0, lane_hi, G, i, lane_lo, j)
    q = torch.stack([byte & 15, byte >> 4], dim=-1).reshape(p * 64, g * 64).float()
    s = s_g.transpose(1, 2).reshape(p * 64, g).float().repeat_interleave(64, dim=1)
    b = b_g.transpose(1, 2).reshape(p * 64, g).float().repeat_interleave(64, dim=1)
    return q * s + b


def _spec(x, wb, s_g, b_g, **_):
    w = dequant_kw4(wb, s_g, b_g).to(x.dtype).float()          # rounded to bf16 once, as the kernel's operand
    return (x.float() @ w.t()).to(x.dtype)


@kd.kernel(tune={"BLOCK_M": kd.choice(16, 32, default=16), "GPI": kd.choice(1, 2, 4, 8, default=4),
                 "SPLIT_K": kd.choice(1, 2, 4, 8, default=1), "num_warps": kd.choice(1, 2, default=1),
                 "num_stages": kd.choice(1, 2, 3, 4, default=3)},
           key=lambda x, wb, s_g, b_g, **_: {"M": x.shape[0]}, spec=_spec)
def qmv_mma(x, wb, s_g, b_g, *, NW: kd.constexpr = 1, BLOCK_M, GPI, SPLIT_K):
    """y (M, N) = x (M, K) @ W.T for pack_kw4's bytes wb (N/64, K/64 * 2048): a program takes 16 NW weight rows
    (NW warps, num_warps must equal it) and BLOCK_M activation rows, GPI groups a K step; split over K (fp32 out)
    or not (x's dtype)."""
    M, K = x.shape
    P, G, _ = s_g.shape
    R, SUBS = 16 * NW, 4 // NW
    pid, pm, pk = kd.grid(P * SUBS, kd.cdiv(M, BLOCK_M), SPLIT_K)
    p, sub = pid // SUBS, pid % SUBS
    rr, gi = kd.arange(0, R), kd.arange(0, GPI)
    mm, kk = pm * BLOCK_M + kd.arange(0, BLOCK_M), kd.arange(0, GS * GPI)
    steps = G // GPI
    per = kd.cdiv(steps, SPLIT_K)
    acc = kd.zeros((R, BLOCK_M), kd.f32)
    for step in kd.range(pk * per, kd.minimum(pk * per + per, steps)):
        g0 = step * GPI
        raw = kd.load(wb, p, (g0 + gi[:, None]) * 2048 + sub * (512 * NW) + kd.arange(0, 512 * NW)[None, :], check=False)
        # (GPI, warp, lane_hi, lane_lo, i, j, o0) -> rows (warp, o0, lane_hi), columns (GPI, i, lane_lo, j)
        byt = kd.reshape(kd.permute(kd.reshape(raw, (GPI, NW, 8, 4, 4, 2, 2)), (1, 6, 2, 0, 4, 3, 5)), (R, GPI * 32))
        a = W.dequantized_tile(byt, s_g, b_g, p, g0 + gi, sub * R + rr)
        acc += kd.dot(a, kd.trans(kd.load(x, mm[:, None], g0 * GS + kk[None, :], check=(True, False))))
    rows = p * 64 + sub * R + rr
    if SPLIT_K == 1:
        out = kd.output((M, P * 64), x.dtype)
        kd.store(out, mm[None, :], rows[:, None], acc)
    else:
        out = kd.output((M, P * 64), kd.f32, zero=True)
        kd.atomic_add(out, mm[None, :], rows[:, None], acc)
    return out


SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = [1, 4, 8]
CONFIGS = [({"BLOCK_M": 16, "GPI": g, "SPLIT_K": s, "num_stages": st, "num_warps": nw}, nw)
           for (g, st), s, nw in itertools.product(((2, 2), (2, 3), (4, 2)), (1, 2), (1, 2))]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    SHAPES, CONFIGS, ROWS = [("o", 128, 512)], CONFIGS[:2], [1, 4]


def main(out: str, rounds: int) -> None:
    """Each shape and row count: the route (and its one-row time as a peer), qmm_wg at its default and the
    probe's settings, checked against cuBLAS on the dequantized weight, then timed in turn; a SUMMARY line each."""
    rows = []
    for name, n, k in SHAPES:
        for m in ROWS:
            p = {"M": m, "N": n, "K": k, "bits": 4, "gs": 64}
            sets = [qmatmul.make_qmatmul_args(p, DEV) for _ in range(copies_for(n * k // 2 + m * k * 2, DEV == "cpu"))]
            ops = [(x, W.flat(W.pack_operand(wq)), W.group_major(s), W.group_major(b)) for x, wq, s, b in sets]
            kw4 = [(x, pack_kw4(wq), W.group_major(s), W.group_major(b)) for x, wq, s, b in sets]
            ws = [(x, QWeight.from_mlx(wq, s, b, bits=4, group_size=64)) for x, wq, s, b in sets]
            want = qmatmul._dense_peer(*sets[0]).float()
            paths = {"route": (qmatmul.qmatmul, ws)}
            if m > 1:
                paths["route_M1"] = (qmatmul.qmatmul, [(x[:1], w) for x, w in ws])
            paths["wg_default"] = (lambda x, wb, s, b: W.qmm_wg(x, wb, s, b), ops)
            for c, nw in CONFIGS:
                tag = f"mma_nw{nw}_gpi{c['GPI']}_split{c['SPLIT_K']}_st{c['num_stages']}"
                paths[tag] = (lambda x, wb, s, b, c=c, nw=nw: qmv_mma(x, wb, s, b, NW=nw, config=c), kw4)
            got = time_paths(f"qmv_b4_M{m}_{name}", paths, want, rounds, peers=("route_M1",))
            rows += got
            best = {}
            for r in got:
                best[r["path"]] = min(best.get(r["path"], 1e9), r["us"])
            mma = min(((v, k) for k, v in best.items() if k.startswith("mma")), default=None)
            print(f"SUMMARY {name} M={m}: route {best.get('route')} route_M1 {best.get('route_M1')} "
                  f"wg {best.get('wg_default')} mma best {mma}", flush=True)
    write_probe_csv(out, rows, DEV)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)
