"""qmv_h2 at one activation row with split-K, its output's zero fill counted and not counted.

Why: the small llama-3.1-8b GEMVs run far from the copy ceiling (o 4096x4096 ~1.8 TB/s, down 4096x14336
~2.3 TB/s) with 512-1024 programs, 4-8 warps an SM; split-K multiplies the programs but its atomic
output needs a zeroed buffer, a fill kernel of its own in the decode graph. This probe asks whether
the GEMV itself gets faster with more splits when the fill is free (as it is when the splits write
fp32 partials that the consumer, the next add+RMSNorm, sums): `fill` times the kernel as it launches
(torch.zeros before it), `no_fill` with the allocation patched to torch.empty (sums of garbage; the
output is checked on the `fill` run).

  GPU:  python bench/probes/splitk_gemv.py OUT_CSV
Timing: bench_kernels.time_calls (CUDA graph over rotating weight copies that do not fit in L2).
"""
from __future__ import annotations

import csv
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_kernels import copies_for, time_calls  # noqa: E402

from kilnx.codegen import launch  # noqa: E402
from kilnx.kernels import qmv_h2  # noqa: E402

SHAPES = {"o": (4096, 4096), "down": (4096, 14336), "qkv": (6144, 4096), "gate_up": (28672, 4096),
          "down_1b": (2048, 8192), "gate_up_1b": (16384, 2048), "lm_head": (128256, 4096)}
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":     # a check of the script under the interpreter
    SHAPES = {"o": (64, 256)}


class _NoFill:
    """torch, with zeros allocating without the fill."""
    zeros = staticmethod(torch.empty)

    def __getattr__(self, name):
        return getattr(torch, name)


def configs(name):
    if DEV == "cpu":
        yield {"BLOCK_N": 64, "BLOCK_KW": 32, "num_warps": 1, "SPLIT_K": 2, "STAGES": 1, "CHAIN": 1}
        return
    tiles = [(4, 128, 1), (4, 256, 2), (8, 128, 2), (8, 64, 1), (16, 128, 2), (4, 64, 1), (2, 256, 1), (8, 256, 2)]
    if os.environ.get("SPLITK_TILES"):   # BLOCK_N x BLOCK_KW x num_warps, comma-separated
        tiles = [tuple(int(v) for v in t.split("x")) for t in os.environ["SPLITK_TILES"].split(",")]
    splits = (1, 2, 4, 8) if name in ("o", "down", "qkv") else (1, 2)
    splits = [int(v) for v in os.environ.get("SPLITK_SPLITS", ",".join(map(str, splits))).split(",")]
    stages = [int(v) for v in os.environ.get("SPLITK_STAGES", "3").split(",")]
    for (bn, kw, nw), sk, st in itertools.product(tiles, splits, stages):
        yield {"BLOCK_N": bn, "BLOCK_KW": kw, "num_warps": nw, "SPLIT_K": sk, "STAGES": st, "CHAIN": 2}


def main(path):
    from kilnx.runtime.bench import provenance
    global META
    META = provenance(DEV)
    rows = []
    for name, (n, k) in SHAPES.items():
        if name not in os.environ.get("SPLITK_SHAPES", "o,down,qkv,gate_up").split(",") and DEV == "cuda":
            continue
        p = {"M": 1, "N": n, "K": k, "bits": 4, "gs": 64}
        wbytes = n * k // 2 + 4 * n * (k // 64)
        sets = [qmv_h2.make_qmv_h2_args(p, DEV) for _ in range(copies_for(wbytes, DEV == "cpu"))]
        default = qmv_h2.qmv_h2.default_config(*sets[0])
        for cfg in [default, *configs(name)]:
            try:
                run = lambda *a, cfg=cfg: qmv_h2.qmv_h2(*a, config=cfg)  # noqa: E731
                got = run(*sets[0]).float()
                want = qmv_h2._spec(*sets[0], BITS=4, GROUP=64).float()
                err = ((got - want).abs().max() / (want.abs().max() + 1e-9)).item()
                assert got.shape == (1, n) and err < 2e-2, f"wrong: rel err {err:.3g}"
                t_fill = time_calls(run, sets)
                real = launch.torch
                launch.torch = _NoFill()
                try:
                    t_nofill = time_calls(run, sets)
                finally:
                    launch.torch = real
            except Exception as e:  # noqa: BLE001 - a config that fails is reported, not fatal
                print(name, cfg, repr(e)[:200], flush=True)
                continue
            row = {**META, "shape": name, "config": str(cfg), "default": cfg is default,
                   "us_fill": round(t_fill * 1e6, 3), "us_no_fill": round(t_nofill * 1e6, 3),
                   "GBps_no_fill": round(wbytes / t_nofill / 1e9, 1)}
            rows.append(row)
            print(row, flush=True)
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, list(row))
                w.writeheader()
                w.writerows(rows)


if __name__ == "__main__":
    main(sys.argv[1])
