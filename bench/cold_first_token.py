"""Seconds from a new process's start to its first generated token, with the kernel caches warm.

    python bench/cold_first_token.py --model llama-3.1-8b [--csv FILE]

Run it twice: the first run fills Triton's and kilnx's on-disk caches, the second is the figure (case
`e2e_<model>_cold_first_token`, metric `s`). Random weights at the preset's real size (made on the GPU)
stand in for reading a checkpoint.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import csv  # noqa: E402
import os  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--csv", default=None)
    a = p.parse_args()
    import torch

    from kilnx.models.loaders import load_model
    from kilnx.runtime.engine import Engine
    from kilnx.runtime.generate import generate_ids
    from kilnx.runtime.sampling import SamplingParams
    lm = load_model(a.model, device=torch.device("cuda"), random=True, random_format="q4")
    engine = Engine(lm.model, max_seq=64)
    for item in generate_ids(engine, list(range(1, 9)), SamplingParams(max_tokens=1, ignore_eos=True)):
        if isinstance(item, int):
            torch.cuda.synchronize()
            break
    seconds = time.perf_counter() - T0
    print(f"{a.model}: first token {seconds:.2f} s after process start")
    if a.csv:
        from kilnx.runtime.bench import provenance
        p = provenance("cuda")
        new = not os.path.exists(a.csv)
        with open(a.csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["suite", "case", "metric", "value", "peer", "peer_value", "device", "torch", "triton",
                            "commit", "date"])
            w.writerow(["e2e", f"e2e_{a.model}_cold_first_token", "s", f"{seconds:.3f}", "", "",
                        p["gpu"], p["torch"], p["triton"], p["commit"], p["date"]])


if __name__ == "__main__":
    main()
