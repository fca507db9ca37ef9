"""Design probe: gate_up's GEMV with the SwiGLU and down's prep in one launch (kernels/swiglu_prep.py) against the two
launches it replaces (qmv_h2, then silu_mul_prep) and against qmv_h2 alone, at llama-3.1-8b's and llama-3.2-1b's
gate_up, 1 and 4 rows, over tiles of a group of h a program (BLOCK_N 128). (Smaller tiles, whose groups were
prepped by the last program to finish, lost and went in session 38: 2026-12-07_h100_swiglu_prep_s38.csv.)

    GPU:  python bench/probes/swiglu_prep.py OUT_CSV [rounds]
Timing: bench_kernels.time_calls (a CUDA graph over input copies that exceed L2, median of replays).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_kernels import copies_for, time_paths, write_probe_csv  # noqa: E402

from kilnx.kernels import prepared  # noqa: E402
from kilnx.kernels import qmv_h2 as H  # noqa: E402
from kilnx.kernels import swiglu_prep as S  # noqa: E402
from kilnx.kernels.qmatmul import make_qmatmul_args  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"llama8b_gate_up": (14336, 4096), "llama1b_gate_up": (8192, 2048)}
TILES = [(128, 64, 4, 3, 2), (128, 128, 4, 3, 2), (128, 128, 8, 3, 2), (128, 64, 8, 3, 2), (128, 32, 4, 3, 2)]


def prepared_args(m, f, k):
    x, wq, scales, biases = make_qmatmul_args({"M": m, "N": 2 * f, "K": k, "bits": 4, "gs": 64}, DEV)
    return (*H.qmv_h2_prep(x, PER=8, GROUP=64), wq, scales, biases)


def main(out: str, rounds: int) -> None:
    rows = []
    for name, (f, k) in SHAPES.items():
        for m in (1, 4):
            sets = [prepared_args(m, f, k) for _ in range(copies_for(f * k + m * k * 2, DEV == "cpu"))]
            two = lambda *a: prepared.silu_mul_prep(H.qmv_h2(*a), PER=8, GROUP=64)[1]    # noqa: E731
            want = two(*sets[0])
            paths = {"gemv_only": (lambda *a: H.qmv_h2(*a), sets), "two_launches": (two, sets),
                     "fused_default": (lambda *a: S.qmv_h2_swiglu_prep(*a, PER_OUT=8, GROUP_OUT=64)[2], sets)}
            for bn, kw, nw, st, ch in TILES:
                cfg = {"BLOCK_N": bn, "BLOCK_KW": kw, "num_warps": nw, "STAGES": st, "CHAIN": ch}
                paths[f"fused_{bn}x{kw}_w{nw}"] = (
                    lambda *a, cfg=cfg: S.qmv_h2_swiglu_prep(*a, PER_OUT=8, GROUP_OUT=64, config=cfg)[2], sets)
            rows += time_paths(f"swiglu_M{m}_{name}", paths, want, rounds, peers=("gemv_only",))
    write_probe_csv(out, rows, DEV)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)
