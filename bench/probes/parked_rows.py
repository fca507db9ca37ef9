"""What parked rows cost: a batched decode step with rows riding along parked, and a hybrid model's first token from
a padded prefill graph, with the attention kernels skipping parked queries (default) against walking the cache as
they did before (KILNX_PARKED_ATTENTION=walk), at serve-sized caches.

    python bench/probes/parked_rows.py OUT.csv [MODEL] [CONTEXTS] [ROWS] [BUCKET] [STEPS] [HYBRID]
    (defaults: llama-3.1-8b, 4096,32768, 5,8, 8, 64, nemotron-h-8b; HYBRID "-" skips the first-token part)

Why: `serve` and `chat` size the cache to 4096 tokens a row by default. A decode step of B live rows runs the
graph of the next bucket: its other rows park (runtime/kv_cache.py's parking slot); a hybrid prompt's padding to
a prefill graph's length parks too. Parked at the cache's last position, such a query's tile walked every key of
the cache in every attention layer (a walk of its row's whole cache: 0.5 GB a step at 4096 slots for llama-3.1-8b).

Decode: an engine of BUCKET rows and a context of S, ROWS live rows (128 random tokens prefilled each), then STEPS
steps timed by `kilnx bench --batch`'s loop (runtime/bench.py batched_greedy); ROWS = BUCKET is the peer with
nothing parked. First token: the hybrid model's engine of one row and a context of S, a 100-token prompt (a
128-token prefill graph, 28 tokens of padding), the median of 5 prefills after one that captures the graph.
Random 4-bit group-64 weights; each setting in a fresh engine, the two alternated twice in one process.
"""

from __future__ import annotations

import csv
import gc
import os
import statistics
import sys
import time

import torch

MODES = {"skip": "", "walk": "walk"}


def _engine(lm, max_seq: int, max_batch: int):
    from kilnx.runtime.engine import Engine
    gc.collect()
    torch.cuda.empty_cache()
    return Engine(lm.model, max_seq=max_seq, max_batch=max_batch)


def decode_rate(lm, max_seq: int, bucket: int, rows: int, steps: int) -> float:
    from kilnx.runtime.bench import batched_greedy
    engine = _engine(lm, max_seq, bucket)
    g = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(0, lm.config.vocab_size, (128,), generator=g).tolist() for _ in range(rows)]
    batched_greedy(engine, prompts, 3)
    return batched_greedy(engine, prompts, steps + 1)[1]


def first_token_ms(lm, max_seq: int) -> tuple[float, int]:
    """(the median first token in ms, the engine's context: the model's own maximum where S is above it)"""
    engine = _engine(lm, max_seq, 1)
    ids = torch.randint(0, lm.config.vocab_size, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.prefill(ids)          # eager, then captured
    times = []
    for _ in range(6):
        engine.synchronize()
        t0 = time.perf_counter()
        engine.prefill(ids)
        engine.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:]), engine.max_seq


def main():
    from kilnx.models.loaders import load_model
    from kilnx.runtime.bench import provenance
    args = sys.argv[1:] + [None] * 7
    out = args[0]
    model = args[1] or "llama-3.1-8b"
    contexts = [int(c) for c in (args[2] or "4096,32768").split(",")]
    row_counts = [int(r) for r in (args[3] or "5,8").split(",")]
    bucket = int(args[4] or 8)
    steps = int(args[5] or 64)
    hybrid = args[6] or "nemotron-h-8b"
    prov = provenance("cuda")
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["case", "model", "context", "rows", "bucket", "parked_attention", "round", "metric", "value",
                    "device", "torch", "triton", "commit", "date"])

        def row(case, name, ctx, rows, mode, rnd, metric, value):
            print(f"{case} {name} S={ctx} rows={rows} {mode} round {rnd}: {metric} {value:.2f}", flush=True)
            w.writerow([case, name, ctx, rows, bucket, mode, rnd, metric, f"{value:.2f}", prov["gpu"], prov["torch"],
                        prov["triton"], os.environ.get("KILNX_COMMIT", prov["commit"]), prov["date"]])
            f.flush()

        lm = load_model(model, device="cuda", random=True, random_format="q4")
        for rnd in range(2):
            for ctx in contexts:
                for rows in row_counts:
                    for mode, env in MODES.items():
                        os.environ["KILNX_PARKED_ATTENTION"] = env
                        row("decode", model, ctx, rows, mode, rnd, "tok_s", decode_rate(lm, ctx, bucket, rows, steps))
        del lm
        if hybrid == "-":
            return
        lm = load_model(hybrid, device="cuda", random=True, random_format="q4")
        for rnd in range(2):
            for ctx in contexts:
                for mode, env in MODES.items():
                    os.environ["KILNX_PARKED_ATTENTION"] = env
                    ms, held = first_token_ms(lm, ctx)
                    row("first_token_100", hybrid, held, 1, mode, rnd, "ms", ms)


if __name__ == "__main__":
    main()
