"""One launch each of the one-pass decode MoE and the two-kernel path's GEMVs at qwen3-30b-a3b's shapes
(one token, 4-bit gs64, prepared x), for `ncu` to profile:

    ncu --clock-control none --set detailed -k regex:"moe_onepass|gather_qmv_h2" python3 bench/profile_moe_onepass.py
Each kernel runs three times (compile, warm, profiled); configs: the defaults.
"""

from __future__ import annotations

import torch

from kilnx.kernels import moe_h2 as MH
from kilnx.kernels import moe_onepass as MO
from kilnx.kernels import qmv_h2 as QH

P = {"T": 1, "top_k": 8, "E": 128, "N": 1536, "K": 2048, "bits": 4, "gs": 64}

if __name__ == "__main__":
    torch.manual_seed(0)
    args = MO.make_args(P, "cuda")
    planes, sums, xs, gq, gs, gb, dq, ds, db, ids, rw = args
    for _ in range(3):
        MO.moe_onepass_h2(*args)
        h = MH.gather_qmv_h2_glu(planes, sums, xs, gq, gs, gb, ids)
        MH.gather_qmv_h2_combine(*QH.qmv_h2_prep(h, PER=8, GROUP=64), dq, ds, db, ids, rw)
    torch.cuda.synchronize()
