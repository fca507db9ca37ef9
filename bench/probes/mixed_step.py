"""Whether a prompt's chunk and a decode step should share one forward (Engine.mixed: each weight read once for
both) rather than run one after the other (the scheduler's turn today: Engine.prefill of the chunk, then the
graph-replayed Engine.decode of the rows decoding). Times both, in one process, over chunk lengths and rows.

  python bench/probes/mixed_step.py OUT_CSV [MODEL] [--random]
On the CPU (SmolLM2-135M, 2 cores; bench/results/2026-12-05_cpu_mixed_step_s27.csv) mixed ran 0.75-1.04x the two
calls: the CPU's GEMMs are compute-bound, so the weight read saved is not what a turn waits for. Whether the
GPU's turn (a chunk of 512 tokens, a graph-replayed step) gains is what this measures there.
"""
from __future__ import annotations

import csv
import datetime
import os
import statistics
import sys
import time

import torch

from kilnx.models.loaders import load_model
from kilnx.runtime.engine import Engine


def timed(fn, reps: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(out: str, model: str = "llama-3.1-8b", random: bool = True):
    cuda = torch.cuda.is_available()
    lm = load_model(model, device="cuda" if cuda else "cpu", random=random)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows, chunks = (1, 4, 8), ((128, 256, 512) if cuda else (60, 124))
    engine = Engine(lm.model, max_seq=1024, max_batch=max(rows) + 1)
    for r in range(max(rows)):
        engine.prefill([1 + r, 2, 3, 4, 5, 6, 7, 8], row=r)
    results = []
    for B in rows:
        tokens = torch.full((B + 1,), 9, dtype=torch.long)
        positions = torch.tensor([8] * B + [engine.max_seq - 1])      # the chunk's row parked, as in a turn
        dev_tokens, dev_positions = tokens.to(engine.device), positions.to(engine.device)
        for C in chunks:
            chunk = [(7 * i) % 1000 + 10 for i in range(C)]
            apart = timed(lambda: (engine.prefill(chunk, row=B, start=0), engine.decode(dev_tokens, dev_positions)),
                          5, sync)
            mixed = timed(lambda: engine.mixed(dev_tokens, dev_positions, chunk, B, 0), 5, sync)
            results.append([model, B, C, f"{apart:.3f}", f"{mixed:.3f}", f"{apart / mixed:.3f}"])
            print(*results[-1], flush=True)
    import triton
    stamp = [torch.cuda.get_device_name() if cuda else "cpu", torch.__version__, triton.__version__,
             os.environ.get("KILNX_COMMIT", "unknown"), datetime.date.today().isoformat()]
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "decode_rows", "chunk", "apart_ms", "mixed_ms", "speedup", "device", "torch", "triton",
                    "commit", "date"])
        w.writerows(r + stamp for r in results)


if __name__ == "__main__":
    a = [x for x in sys.argv[1:] if x != "--random"]
    main(a[0] if a else "mixed_step.csv", a[1] if len(a) > 1 else "llama-3.1-8b", "--random" in sys.argv)
