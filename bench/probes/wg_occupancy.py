"""qmm_wg at 4 rows with more bytes in flight or more programs resident an SM: the K split, the stages and the
groups a step varied together, against the shipped route at 4 rows and at one row, in one run.

Why: ncu of the 4-row gate_up (bench/results/profiles/2026-12-05_h200_ncu_wg_gate_up_s25.txt) found every wgmma
GEMV latency-bound with 448 one-warpgroup programs, 0.68-0.85 waves and ~20% achieved occupancy. Session 20's
sweep (bench/results/2026-12-05_h200_tc_qmm_s20.csv) tried 1 and 3 stages; here 2, 3 and 4, with the splits that
give 1-4x the programs.

  GPU:  python bench/probes/wg_occupancy.py OUT_CSV [rounds]
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

from kilnx.kernels import qmatmul, qmv_wg  # noqa: E402
from kilnx.quant import QWeight  # noqa: E402

SHAPES = [("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = [4]
CONFIGS = [{"BLOCK_M": 16, "GPI": g, "SPLIT_K": s, "num_stages": st}
           for g, s, st in itertools.product((2, 4), (1, 2, 4), (2, 3, 4))]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":     # a check of the script under the interpreter
    SHAPES, CONFIGS = [("o", 64, 256)], CONFIGS[:2]


def main(out: str, rounds: int) -> None:
    rows = []
    for name, n, k in SHAPES:
        for m in ROWS:
            p = {"M": m, "N": n, "K": k, "bits": 4, "gs": 64}
            sets = [qmatmul.make_qmatmul_args(p, DEV) for _ in range(copies_for(n * k // 2 + m * k * 2, DEV == "cpu"))]
            ops = [(x, qmv_wg.flat(qmv_wg.pack_operand(wq)), qmv_wg.group_major(s), qmv_wg.group_major(b))
                   for x, wq, s, b in sets]
            ws = [(x, QWeight.from_mlx(wq, s, b, bits=4, group_size=64)) for x, wq, s, b in sets]
            want = qmatmul._dense_peer(*sets[0]).float()
            base = qmv_wg.qmm_wg.default_config(*ops[0])
            paths = {"route": (qmatmul.qmatmul, ws),
                     "route_M1": (qmatmul.qmatmul, [(x[:1], w) for x, w in ws])}     # one row: a peer
            for c in CONFIGS:
                tag = f"wg_gpi{c['GPI']}_split{c['SPLIT_K']}_st{c['num_stages']}" + ("_default" if c == base else "")
                paths[tag] = (lambda x, wb, s, b, c=c: qmv_wg.qmm_wg(x, wb, s, b, config=c), ops)
            rows += time_paths(f"qmv_b4_M{m}_{name}", paths, want, rounds, peers=("route_M1",))
    write_probe_csv(out, rows, DEV)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)
