"""One launch each of the wgmma GEMVs on llama-3.1-8b gate_up at 4 rows, for `ncu` to compare: qmm_wg on its
repacked copy, qmm_wg_direct on MLX's layout (plain, INTERLEAVE, X_PERMUTED) — why the direct kernel loses on
the bandwidth-bound projections (bench/results/README.md, session 21) is what the profile is for.

    ncu --clock-control none --set detailed -k regex:qmm_wg python3 bench/profile_wg.py [N K M]
"""

from __future__ import annotations

import sys

import torch

from kilnx.kernels import qmv_wg as W
from kilnx.kernels import wg_direct as D
from kilnx.kernels.qmatmul import make_qmatmul_args

if __name__ == "__main__":
    n, k, m = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (28672, 4096, 4)
    x, wq, s, b = make_qmatmul_args({"M": m, "N": n, "K": k, "bits": 4, "gs": 64}, "cuda")
    op = (W.flat(W.pack_operand(wq)), W.group_major(s), W.group_major(b))
    wb, done, xp = D.as_bytes(wq), D.counters_for(x, n), D.permute_k(x)
    base = D.qmm_wg_direct.default_config(x, wb, s, b, done)
    calls = [("qmm_wg", lambda: W.qmm_wg(x, *op)),
             ("direct", lambda: D.qmm_wg_direct(x, wb, s, b, done, config=base)),
             ("direct_interleave", lambda: D.qmm_wg_direct(x, wb, s, b, done, config={
                 **base, "INTERLEAVE": True, "SPLIT_K": max(2, base["SPLIT_K"])})),   # INTERLEAVE needs a split
             ("direct_xperm", lambda: D.qmm_wg_direct(xp, wb, s, b, done, X_PERMUTED=True, config=base))]
    for _ in range(3):      # compile and warm; ncu --launch-skip passes these
        for _, call in calls:
            call()
    torch.cuda.synchronize()
    for _, call in calls:   # the profiled launches (--launch-skip 12)
        call()
    torch.cuda.synchronize()
    print("configs:", W.qmm_wg.default_config(x, *op), base, flush=True)
