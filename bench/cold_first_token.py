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
    p.add_argument("--profile", default=None, help="write cProfile's top functions (cumulative) here")
    a = p.parse_args()
    if a.profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        try:
            run(a)
        finally:
            prof.disable()
            with open(a.profile, "w") as f:
                pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(70)
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
        return
    run(a)


def run(a):
    import torch
    torch.cuda.init()
    phases = {"import_torch_cuda_init": time.perf_counter() - T0}

    from kilnx.models.loaders import load_model
    from kilnx.runtime.engine import Engine
    from kilnx.runtime.generate import generate_ids
    from kilnx.runtime.sampling import SamplingParams
    phases["import_kilnx"] = time.perf_counter() - T0
    lm = load_model(a.model, device=torch.device("cuda"), random=True, random_format="q4")
    torch.cuda.synchronize()
    phases["load_model"] = time.perf_counter() - T0
    engine = Engine(lm.model, max_seq=64)     # loads tuned configs, compiles/loads kernels, captures graphs
    torch.cuda.synchronize()
    phases["engine_graph_capture"] = time.perf_counter() - T0
    for item in generate_ids(engine, list(range(1, 9)), SamplingParams(max_tokens=1, ignore_eos=True)):
        if isinstance(item, int):
            torch.cuda.synchronize()
            break
    seconds = time.perf_counter() - T0
    phases["prefill_first_token"] = seconds
    print(f"{a.model}: first token {seconds:.2f} s after process start; phases (cumulative s): "
          + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
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
            for k, v in phases.items():    # where the time goes (cumulative from process start)
                w.writerow(["e2e_phase", f"e2e_{a.model}_cold_until_{k}", "s", f"{v:.3f}", "", "",
                            p["gpu"], p["torch"], p["triton"], p["commit"], p["date"]])


if __name__ == "__main__":
    main()
