"""The fused 4-bit qmm's tiles against the two-kernel path (dequantize, then the dense mm) at 65-320 rows.

Why: above 64 rows the fused kernel's default tile is 128 x 128 x 64, which gives o, qkv and down fewer
programs than SMs up to 256 rows, so the route sent them to the two-kernel path (routing.two_kernels_win).
The session-16 tune found 64 x 64 x 128 tiles at 128 rows 2.0-2.8x faster than that default (o 31.8 us,
qkv 45.9, down 115.9), below the two-kernel times measured in session 15 (40-46, 55-62, 129-157). Here
every path on the same inputs in one run, alternated over `rounds`, at the rows a prefill chunk has.

  GPU:  python bench/probes/qmm_rows.py OUT_CSV [rounds]
Timing: bench_kernels.time_calls (a CUDA graph over input copies that exceed L2, median of replays).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_kernels import copies_for, time_paths, write_probe_csv  # noqa: E402

from kilnx.kernels import qmatmul  # noqa: E402
from kilnx.quant import QWeight  # noqa: E402

SHAPES = [("o", 4096, 4096), ("qkv", 6144, 4096), ("down", 4096, 14336), ("gate_up", 28672, 4096)]
ROWS = [80, 128, 192, 256, 320]
PACKED = {"SWAP": True, "MAGIC": True, "PACKED": True, "num_stages": 3}
TILES = {"64x64x128_w4": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, **PACKED),
         "64x64x128_w8": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=8, **PACKED),
         "64x128x64_w4": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, **PACKED),
         "128x128x64_w8": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, **PACKED)}
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":     # a check of the script under the interpreter
    SHAPES, ROWS = [("o", 64, 128)], [80]
    TILES = {"64x64x128_w4": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4)}


def main(out: str, rounds: int) -> None:
    rows = []
    for name, n, k in SHAPES:
        for m in ROWS:
            p = {"M": m, "N": n, "K": k, "bits": 4, "gs": 64}
            sets = [qmatmul.make_qmatmul_args(p, DEV) for _ in range(copies_for(n * k // 2 + m * k * 2, DEV == "cpu"))]
            dense = [(x, qmatmul._dense_spec_weight(x, wq, s, b)) for x, wq, s, b in sets]
            ws = {id(wq): QWeight.from_mlx(wq, s, b, bits=4, group_size=64) for _, wq, s, b in sets}
            paths = {f"fused_{t}": (lambda x, wq, s, b, c=c: qmatmul.qmm(x, wq, s, b, config=c), sets)
                     for t, c in TILES.items()}
            paths["two_kernels"] = (qmatmul.dequant_mm, sets)
            paths["route"] = (lambda x, wq, s, b: qmatmul.qmatmul(x, ws[id(wq)]), sets)
            paths["cublas_bf16"] = (lambda x, w: x @ w.T, dense)
            want = qmatmul._dense_peer(*sets[0]).float()
            rows += time_paths(f"qmm_b4_M{m}_{name}", paths, want, rounds, peers=("cublas_bf16",))
    write_probe_csv(out, rows, DEV)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)
