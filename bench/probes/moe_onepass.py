"""The one-pass decode MoE (kernels/moe_onepass.py) against the paths it would replace, by expert width.

Why: at qwen3-30b-a3b's shapes (768 features per expert, top-8) the one pass measured slower than the
two-kernel decode (16.7 against 14.9 us at one token, session 17); the issue expects the crossover to
depend on the expert width. Here, on prepared activations (as a layer's norm hands them over), at one
token, alternated over `rounds`:
  - qwen3-30b-a3b (E 128, top-8, H 2048, F 768) and mixtral-8x7b (E 8, top-2, H 4096, F 14336):
    moe_h2's two kernels (gate_up + SwiGLU, prep of h, down + combine) against the one pass;
  - llama-3.1-8b's dense MLP as one expert (H 4096, F 14336): qmv_h2 gate_up, silu_mul_prep, qmv_h2 down
    (the model's decode path) against the one pass.
One-pass configs: the default and a few around it, each with down in MLX's layout and transposed
(`onepass_t_*`: moe_onepass.down_transposed, read along output rows).

  GPU:  python bench/probes/moe_onepass.py OUT_CSV [rounds]
Timing: bench_kernels.time_calls (a CUDA graph over input copies, median of replays); MoE copies route
to other experts where the stack has enough of them.
"""
from __future__ import annotations

import csv
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_kernels import time_calls  # noqa: E402

from kilnx.kernels import moe_h2 as MH  # noqa: E402
from kilnx.kernels import moe_onepass as MO  # noqa: E402
from kilnx.kernels import prepared as P  # noqa: E402
from kilnx.kernels import qmv_h2 as QH  # noqa: E402
from kilnx.kernels.moe_specs import random_expert_weights  # noqa: E402
from kilnx.quant import QWeight  # noqa: E402
from kilnx.runtime.bench import provenance  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [("qwen3_30b_a3b", 128, 8, 2048, 768), ("mixtral_8x7b", 8, 2, 4096, 14336), ("llama8b_mlp", 1, 1, 4096, 14336)]
CONFIGS = {"f32_h512_w8": dict(BLOCK_F=32, BLOCK_KW=64, BLOCK_H=512, num_warps=8, STAGES=3),
           "f64_h512_w8": dict(BLOCK_F=64, BLOCK_KW=64, BLOCK_H=512, num_warps=8, STAGES=3),
           "f64_h256_w8": dict(BLOCK_F=64, BLOCK_KW=128, BLOCK_H=256, num_warps=8, STAGES=3),
           "f32_h1024_w4": dict(BLOCK_F=32, BLOCK_KW=64, BLOCK_H=1024, num_warps=4, STAGES=3)}
if DEV == "cpu":     # a check of the script under the interpreter
    SHAPES = [("tiny", 4, 2, 128, 64), ("tiny_dense", 1, 1, 128, 64)]
    CONFIGS = {"f16": dict(BLOCK_F=16, BLOCK_KW=16, BLOCK_H=64, num_warps=4, STAGES=1)}


def stack(E, N, K):
    wq, s, b = random_expert_weights(E, N, K, 4, 64)
    return QWeight.from_mlx(wq.to(DEV), s.to(DEV), b.to(DEV), bits=4, group_size=64)


def main(out_csv: str, rounds: int = 2):
    prov = provenance(DEV)
    rows = []
    for name, E, k, H, F in SHAPES:
        gu, dn = stack(E, 2 * F, H), stack(E, H, F)
        copies = max(2, min(16, E // k))
        sets = []
        for i in range(copies):
            ids = ((torch.arange(k) + i * k) % E).reshape(1, k).to(DEV)
            x = torch.randn(1, H).bfloat16().to(DEV)
            rw = torch.softmax(torch.randn(1, k), -1).bfloat16().to(DEV)
            sets.append((QH.qmv_h2_prep(x, PER=8, GROUP=64), ids, rw))
        paths = {}
        if E > 1:
            paths["two_kernels"] = lambda p, ids, rw: MH.two_kernels(*p, gu.packed, gu.scales, gu.biases, dn.packed,
                                                                     dn.scales, dn.biases, ids, rw)
        else:
            g2, d2 = QWeight.from_mlx(gu.packed[0], gu.scales[0], gu.biases[0], bits=4, group_size=64), \
                QWeight.from_mlx(dn.packed[0], dn.scales[0], dn.biases[0], bits=4, group_size=64)

            def dense_mlp(p, ids, rw):
                h = QH.qmv_h2(*p, g2.packed, g2.scales, g2.biases)
                return P.qmatmul_prepared(P.silu_mul_prepared(h, (8, 64)), d2)
            paths["dense_mlp"] = dense_mlp
        dn_t = MO.down_transposed(dn)       # down read along its output rows (session 18)
        for tag, down in (("", dn), ("t_", dn_t)):
            paths[f"onepass_{tag}default"] = lambda p, ids, rw, down=down: MO.moe_onepass(*p, gu, down, ids, rw)
            for cname, cfg in CONFIGS.items():
                paths[f"onepass_{tag}{cname}"] = lambda p, ids, rw, cfg=cfg, down=down: MO.moe_onepass(
                    *p, gu, down, ids, rw, config=cfg)
        ref = paths["two_kernels" if E > 1 else "dense_mlp"](*sets[0]).float()
        scale = ref.abs().max().item() + 1e-9
        for r in range(rounds):
            for pname, fn in paths.items():
                try:
                    err = ((fn(*sets[0]).float() - ref).abs().max().item() / scale) * (E > 1 or pname != "dense_mlp")
                    us = time_calls(fn, sets) * 1e6
                except Exception as e:  # noqa: BLE001 - a failing config is a row, not the end of the run
                    print(name, pname, repr(e)[:200])
                    continue
                print(f"{name} {pname} round {r}: {us:.2f} us (rel diff {err:.2e})", flush=True)
                rows.append({"shape": name, "path": pname, "round": r, "us": round(us, 2), "rel_diff": f"{err:.2e}",
                             **prov})
    with open(out_csv, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)
