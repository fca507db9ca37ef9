"""The Mamba-2 mixer's kernels at nemotron-h-8b's sizes (H 128, P 64, G 8, N 128, conv 10240 channels, bf16
activations, fp32 state), against the layer's own in_proj GEMM in the same run:

    python bench/probes/ssm_mixer.py OUT_CSV [CASES]     (CASES: T:nseq,... ; SSM_PROBE_DEVICE=cpu for a smoke run)

Rows: the token-by-token scan and the chunked (SSD) scan at prompt lengths 128 / 512 / 2048 (one sequence) and the
token-by-token scan at decode (1 token, 1 / 4 / 16 rows), the causal conv at the same sizes, and qmatmul of the
in_proj weight (18560 x 4096, 4-bit groups of 64) on the same tokens: `ratio_vs_in_proj` = kernel time / that
GEMM's, the share of a Mamba-2 layer the kernel adds to its largest weight's product. Timing: kilnx.tuner.timing
(CUDA-graph replays, L2 flushed, median); default configs. Inputs start every sequence at position 0 (a prompt's
first chunk), so reruns compute the same thing.
"""
from __future__ import annotations

import csv
import os
import sys

import torch

from kilnx.kernels import ssm
from kilnx.tuner.timing import benchmark

CASES = [(1, 1), (1, 4), (1, 16), (128, 1), (512, 1), (2048, 1)]      # (tokens per sequence, sequences)


def main(path: str, cases=CASES):
    from kilnx.ops import qmatmul
    from kilnx.quant import QWeight
    from kilnx.runtime.bench import provenance
    dev = os.environ.get("SSM_PROBE_DEVICE", "cuda")
    prov = provenance(dev)
    w = QWeight.quantize(torch.randn(18560, 4096) * 0.02, bits=4, group_size=64).to(dev)
    w = QWeight.from_mlx(w.packed, w.scales.bfloat16(), w.biases.bfloat16(), bits=4, group_size=64)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["case", "T", "nseq", "us", "in_proj_us", "ratio_vs_in_proj", "device", "torch", "triton",
                      "commit", "date"])
        for T, nseq in cases:
            p = dict(ssm.MIXER, T=T, nseq=nseq)
            torch.manual_seed(0)
            scan_args = ssm._scan_problem_args(p, dev)
            conv_args = ssm._conv_problem_args(p, dev)
            x = torch.randn(T * nseq, 4096, device=dev).bfloat16()
            gemm = benchmark(lambda: qmatmul(x, w), dev)
            kernels = {"conv1d_silu": lambda: ssm.conv1d_silu_kernel(*conv_args),
                       "scan_token_by_token": lambda: ssm.ssm_scan_kernel(*scan_args)}
            if T > 1:
                kernels["scan_chunked"] = lambda: ssm.ssm_chunk_scan_kernel(*scan_args)
            for name, fn in kernels.items():
                t = benchmark(fn, dev)
                print(f"{name} T={T} nseq={nseq}: {t * 1e6:.1f} us (in_proj {gemm * 1e6:.1f} us)", flush=True)
                out.writerow([name, T, nseq, f"{t * 1e6:.2f}", f"{gemm * 1e6:.2f}", f"{t / gemm:.3f}", prov["gpu"],
                              prov["torch"], prov["triton"], os.environ.get("KILNX_COMMIT", prov["commit"]),
                              prov["date"]])
                f.flush()


if __name__ == "__main__":
    main(sys.argv[1], [tuple(int(v) for v in c.split(":")) for c in sys.argv[2].split(",")] if len(sys.argv) > 2
         else CASES)
