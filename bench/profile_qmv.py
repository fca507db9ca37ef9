"""One launch of each GEMV variant on llama-3.1-8b gate_up (M=1, 4-bit gs64), for `ncu` to profile.

    ncu --clock-control none --set detailed -k regex:qmv python3 bench/profile_qmv.py
The configs are the best each variant reached in bench/results (passed as JSON to override; a list
for "qmv_h2" profiles each of its configs in turn; "default" is the kernel's shape-aware default).
QMV_NK="N K" profiles another shape (o: "4096 4096", down: "4096 14336").
"""

from __future__ import annotations

import json
import os
import sys

import torch

from kilnx.kernels import qmatmul, qmv_h2

P = {"M": 1, "N": 28672, "K": 4096, "bits": 4, "gs": 64}
CONFIGS = {"qmv": {"BLOCK_KW": 128, "BLOCK_N": 16, "MAGIC": True, "SPLIT_K": 1, "STAGES": 1, "num_warps": 2},
           "qmv_h2": {"BLOCK_KW": 128, "BLOCK_N": 16, "SPLIT_K": 1, "STAGES": 1, "num_warps": 2}}

if __name__ == "__main__":
    if len(sys.argv) > 1:
        CONFIGS.update(json.loads(sys.argv[1]))
    if os.environ.get("QMV_NK"):
        P["N"], P["K"] = (int(v) for v in os.environ["QMV_NK"].split())
    a = qmatmul.make_qmv_args(P, "cuda")
    b = qmv_h2.make_qmv_h2_args(P, "cuda")
    h2 = CONFIGS["qmv_h2"] if isinstance(CONFIGS["qmv_h2"], list) else [CONFIGS["qmv_h2"]]
    h2 = [qmv_h2.qmv_h2.default_config(*b) if c == "default" else c for c in h2]
    print("qmv_h2 configs:", h2, flush=True)
    for _ in range(3):   # compile and warm, then the profiled launches
        qmatmul.qmv(*a, config=CONFIGS["qmv"])
        for cfg in h2:
            qmv_h2.qmv_h2(*b, config=cfg)
    torch.cuda.synchronize()
    print("done")
