"""Batched decode throughput: B sequences stepped together through the engine's CUDA graph of that batch,
under each of qmatmul's settings for 4-16 rows, in one process.

    python bench/probes/batch_decode.py OUT.csv [MODEL] [BATCHES] [STEPS] [SETTINGS]
    (defaults: llama-3.1-8b, 1,2,4,8,16, 64, default,direct,off)

Why: `kilnx bench` times one sequence; a server steps several at once, and every projection of such a
step is a qmatmul of B rows (B = 2-16: the GEMV's sizes, where qmv_h2's time grows with the rows and the
wgmma kernel's does not). Random 4-bit group-64 weights at the model's real size; each row's prompt is
128 random tokens, prefilled into its cache row; then STEPS decode steps are timed by `kilnx bench --batch`'s loop
(runtime/bench.py `batched_greedy`, after an untimed pass), tok/s = B * STEPS / seconds. (Session 21's CSV
came from this probe's own loop of the same steps, at b7b068d.) The settings (KILNX_WG): `default` the route's
choice (qmm_wg on a repacked copy for large weights, qmm_wg_direct for the others; kernels/routing.py),
`direct` qmm_wg_direct for all, `repacked` (KILNX_WG=1) the copy for all, `off` (KILNX_WG=0) qmv_h2 and qmv_tc,
`rule` (KILNX_QMATMUL_PATH=rule) the route's thresholds with any tuned per-row path set aside
(kernels/qmatmul_path.py; with a tuned DB, `default` against `rule` is the tuned paths' gain).
They alternate twice, each in a fresh engine (its graphs captured under that setting); the peers in the same
run are the other settings.
"""

from __future__ import annotations

import csv
import os
import sys

import torch


def decode_rate(lm, batch: int, steps: int, prompt: int = 128) -> float:
    """Decode tok/s summed over `batch` rows: kilnx bench's batched greedy loop, once untimed (it captures
    the engine's graphs) and once timed."""
    from kilnx.runtime.bench import batched_greedy
    from kilnx.runtime.engine import Engine
    engine = Engine(lm.model, max_seq=prompt + steps + 8, max_batch=batch)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, lm.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(batch)]
    batched_greedy(engine, prompts, 3)
    return batched_greedy(engine, prompts, steps + 1)[1]


def main():
    from kilnx.models.loaders import load_model
    from kilnx.runtime.bench import provenance
    out = sys.argv[1]
    model = sys.argv[2] if len(sys.argv) > 2 else "llama-3.1-8b"
    batches = [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4,8,16").split(",")]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    settings = (sys.argv[5] if len(sys.argv) > 5 else "default,direct,off").split(",")
    dev = os.environ.get("BATCH_DECODE_DEVICE", "cuda")     # cpu: a smoke run of the probe itself
    lm = load_model(model, device=dev, random=True, random_format="q4")
    prov = provenance(dev)
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "batch", "wg_route", "round", "decode_tok_s", "device", "torch", "triton", "commit",
                    "date"])
        for rnd in range(2):
            for batch in batches:
                for route in settings:
                    os.environ.update(SETTINGS[route])
                    _forget_served()
                    rate = decode_rate(lm, batch, steps)
                    print(f"{model} B={batch} route {route} round {rnd}: {rate:.1f} tok/s", flush=True)
                    w.writerow([model, batch, route, rnd, f"{rate:.1f}", prov["gpu"], prov["torch"], prov["triton"],
                                os.environ.get("KILNX_COMMIT", prov["commit"]), prov["date"]])
                    f.flush()


SETTINGS = {name: {"KILNX_WG": wg, "KILNX_QMATMUL_PATH": "rule" if name == "rule" else ""}
            for name, wg in (("default", ""), ("rule", ""), ("direct", "direct"), ("repacked", "1"), ("off", "0"))}


def _forget_served():
    """qmatmul keeps its chosen call per weight and row count, the producers their output form: a new tuning
    generation drops them so that the next engine's graphs are captured under the current KILNX_WG."""
    from kilnx.dsl.kernel import forget_remembered_configs
    forget_remembered_configs()


if __name__ == "__main__":
    main()
