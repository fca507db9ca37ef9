"""Where qmv_h2 at several rows departs from the dense product: every rows x config on llama-3.1-8b's o shape.

Why: session 34's step trial saw a decode step's logits off by 1.3 (relative) with o on qmv_h2 at 16 rows, a path
no route takes by default; the interpreter's tests of qmv_h2 at 16 rows (every CHAIN, STAGES 1 and 3) pass, so the
break is in what the GPU compiles. This prints, per rows and config, the largest error against the fp32 product of
the same prepared activations and dequantized weight, relative to the largest output, and writes them as CSV: the
configs and row counts that break say which part of the kernel to read.

  GPU:  python bench/probes/qmv_rows_check.py OUT_CSV
"""
from __future__ import annotations

import csv
import itertools
import sys

import torch

from kilnx.kernels import qmv_h2 as H
from kilnx.quant import QWeight

DEV = "cuda" if torch.cuda.is_available() else "cpu"
N, K = (4096, 4096) if DEV == "cuda" else (16, 256)
ROWS = [1, 8, 9, 16] if DEV == "cuda" else [1, 16]
BLOCKS = [(8, 128, 2), (8, 64, 1), (16, 256, 4)] if DEV == "cuda" else [(8, 128, 2)]
STAGES, CHAINS = [1, 3], [1, 4]


def check(rows: int, config: dict, x: torch.Tensor, w: QWeight, want: torch.Tensor) -> float:
    planes, sums, xs = (t.to(DEV) for t in H._prep_spec(x.cpu().float(), PER=8, GROUP=64))
    got = H.qmv_h2(planes, sums, xs, w.packed, w.scales, w.biases, config=config).float().cpu()
    return (got - want).abs().max().item() / want.abs().max().item()


def main(out: str) -> None:
    g = torch.Generator().manual_seed(34)
    w = QWeight.quantize((torch.randn(N, K, generator=g) * 0.02).bfloat16(), bits=4, group_size=64).to(DEV)
    dense = w.dequantize(torch.float32).cpu()
    # each row written as it is measured: a run cut at its time limit keeps what it did (session 36's lost its CSV)
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["rows", "BLOCK_N", "BLOCK_KW", "num_warps", "STAGES", "CHAIN", "SPLIT_K", "rel_err"])
        for rows in ROWS:
            x = torch.randn(rows, K, generator=g).bfloat16().float()
            want = x @ dense.T
            for (bn, kw, nw), stages, chain in itertools.product(BLOCKS, STAGES, CHAINS):
                config = {"BLOCK_N": bn, "BLOCK_KW": kw, "num_warps": nw, "STAGES": stages, "CHAIN": chain,
                          "SPLIT_K": 1}
                try:
                    err = f"{check(rows, config, x, w, want):.3g}"
                except Exception as e:   # noqa: BLE001 - a config that fails to compile is a row too
                    err = f"error: {type(e).__name__}: {str(e)[:80]}"
                print(f"rows {rows:2d} BLOCK_N {bn:2d} BLOCK_KW {kw:3d} warps {nw} STAGES {stages} CHAIN {chain}: {err}",
                      flush=True)
                writer.writerow([rows, *config.values(), err])
                f.flush()


if __name__ == "__main__":
    main(sys.argv[1])
