"""The dense GEMM at prefill rows: the persistent default against the 2-d grid's old default and cuBLAS.

Why: prefill multiplies 2048-token chunks by each weight's bf16 copy (qmatmul's dequant + mm route), and
the persistent variant (one program per SM, tile and K loops flattened) was measured only on gate_up at
M = 512 and 4096 in the quant bench. Here every llama-3.1-8b projection at M = 2048, and gate_up at 512
and 4096, each (kilnx config, cuBLAS) pair timed in `rounds` alternations so drift shows as spread.

  GPU:  python bench/probes/mm_prefill.py OUT_CSV [rounds]
Timing: bench_kernels.time_calls (a CUDA graph over input copies that exceed L2, median of replays).
"""
from __future__ import annotations

import csv
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_kernels import copies_for, time_calls  # noqa: E402

from kilnx.kernels import qmatmul  # noqa: E402

SHAPES = [("qkv", 2048, 6144, 4096), ("o", 2048, 4096, 4096), ("gate_up", 2048, 28672, 4096),
          ("down", 2048, 4096, 14336), ("gate_up", 512, 28672, 4096), ("gate_up", 4096, 28672, 4096)]
GRID_DEFAULT = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3,
                "PERSISTENT": False}   # the old default from 2048 rows (a 2-d grid)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":     # a check of the script under the interpreter
    SHAPES = [("o", 32, 64, 64)]


def main(out: str, rounds: int) -> None:
    rows = []
    for name, m, n, k in SHAPES:
        sets = [(torch.randn(m, k, device=DEV).bfloat16(), torch.randn(n, k, device=DEV).bfloat16())
                for _ in range(copies_for((m + n) * k * 2, DEV == "cpu"))]
        want = sets[0][0].float() @ sets[0][1].float().T
        default = qmatmul.mm.default_config(*sets[0])
        paths = {"cublas": lambda x, w: x @ w.T,
                 "kilnx_default": lambda x, w: qmatmul.mm(x, w),
                 "kilnx_grid": lambda x, w: qmatmul.mm(x, w, config=GRID_DEFAULT)}
        for path, fn in paths.items():
            err = (fn(*sets[0]).float() - want).abs().max().item() / want.abs().max().item()
            assert err < 2e-2, f"{name} M={m} {path}: relative error {err}"
        for r in range(rounds):
            for path, fn in paths.items():
                us = time_calls(fn, sets, reps=10) * 1e6
                rows.append({"case": f"mm_{name}_M{m}", "path": path, "round": r, "us": round(us, 2),
                             "TFLOPs": round(2 * m * n * k / us / 1e6, 1),
                             "config": str(default) if path == "kilnx_default" else ""})
                print(rows[-1], flush=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
