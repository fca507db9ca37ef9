"""Serving throughput: N requests at once through `kilnx serve`'s scheduler (runtime/scheduler.py), with the
cache rows it may decode together (max_batch) varied, in one process — the peer in the same run is
max_batch 1 (requests one after another, each decoded alone, as a server without batching would).

    python bench/probes/serve_load.py OUT.csv [MODEL] [MAX_BATCHES] [REQUESTS] [TOKENS] [--random]
    (defaults: smollm2-135m, 1,4,8, 8, 64)
    python bench/probes/serve_load.py OUT.csv [MODEL] --prefix [HISTORY]     (default HISTORY 1024)
    python bench/probes/serve_load.py OUT.csv [MODEL] --system [LENGTH]      (default LENGTH 512)
    python bench/probes/serve_load.py OUT.csv [MODEL] --conversations [COUNT] (default COUNT 6)

Each request is a distinct random prompt of 32 tokens (seeded) and decodes exactly TOKENS tokens (greedy,
ignore_eos); all are submitted at once. Reported per setting: wall seconds until the last finishes, generated
tok/s over that wall time, mean and worst time to a request's first token, and the decode steps run (a step
of B busy rows counts once). Each setting runs once untimed first (numba compiles, CPU step recordings, CUDA
graph captures), then timed.
"""

from __future__ import annotations

import csv
import statistics
import sys
import threading
import time

import torch


def run(lm, max_batch: int, prompts: list[list[int]], tokens: int) -> dict:
    from kilnx.runtime.engine import Engine
    from kilnx.runtime.sampling import SamplingParams
    from kilnx.runtime.scheduler import Scheduler
    engine = Engine(lm.model, max_seq=len(prompts[0]) + tokens + 1, max_batch=max_batch)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    with Scheduler(engine) as sched:
        for timed in (False, True):
            first, done, finished = {}, {}, threading.Event()
            steps0 = sched.steps
            t0 = time.perf_counter()

            def listener(i):
                def on_event(kind, payload):
                    if kind == "done":
                        done[i] = time.perf_counter()
                        first.setdefault(i, done[i])
                        if len(done) == len(prompts):
                            finished.set()
                return on_event
            reqs = [sched.submit(p, params, listener(i)) for i, p in enumerate(prompts)]
            while not finished.wait(0.002):              # first tokens: poll the requests' token lists
                for i, r in enumerate(reqs):
                    if r.tokens and i not in first:
                        first[i] = time.perf_counter()
            wall = max(done.values()) - t0
            assert all(len(r.tokens) == tokens for r in reqs)
    ttfts = [first[i] - t0 for i in range(len(prompts))]
    return {"max_batch": max_batch, "requests": len(prompts), "tokens_each": tokens, "wall_s": round(wall, 4),
            "tok_s": round(len(prompts) * tokens / wall, 2), "ttft_mean_s": round(statistics.mean(ttfts), 4),
            "ttft_max_s": round(max(ttfts), 4), "steps": sched.steps - steps0}


def prefix_reuse(lm, history: int, repeats: int = 3) -> list[dict]:
    """A conversation's next turn: a HISTORY-token prompt was served and its row kept; the next prompt is that
    history, the 16 tokens generated, and 16 new ones. Time to its first token with the row's kept tokens
    reused against the same scheduler with what rows keep forgotten (a prefill from scratch), alternated."""
    from kilnx.runtime.engine import Engine
    from kilnx.runtime.sampling import SamplingParams
    from kilnx.runtime.scheduler import Scheduler
    g = torch.Generator().manual_seed(1)
    first = torch.randint(3, lm.config.vocab_size, (history,), generator=g).tolist()
    new = torch.randint(3, lm.config.vocab_size, (16,), generator=g).tolist()
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    rows = []
    with Scheduler(Engine(lm.model, max_seq=history + 64, max_batch=1)) as sched:
        reply = list(list(sched.stream(first, sp))[-1].token_ids)
        turn = first + reply + new
        for rep in range(repeats + 1):
            for reuse in (True, False):
                if not reuse:
                    sched.kept[0] = []
                else:                               # the first turn's state: its prompt and reply in the row
                    list(sched.stream(first, sp))
                t0 = time.perf_counter()
                fin = list(sched.stream(turn, one))[-1]
                seconds = time.perf_counter() - t0
                if rep:                             # the first round compiles the new prefill shapes
                    rows.append({"history": history, "prompt_tokens": len(turn), "reuse": reuse,
                                 "cached_tokens": fin.cached_tokens, "ttft_s": round(seconds, 4)})
    return rows


def shared_system_prompt(lm, length: int, requests: int = 8, repeats: int = 2) -> list[dict]:
    """REQUESTS requests arriving together that share a LENGTH-token system prompt (each its own 16-token
    tail, 16 tokens out): the first prefills the prefix and the others copy its K/V once it is written
    (scheduler COPY_MIN), against the same scheduler with copying off (every request prefills it). Mean and
    worst time to a request's first token, and the wall time, alternated REPEATS times after a warm-up."""
    from kilnx.runtime import scheduler as S
    from kilnx.runtime.engine import Engine
    from kilnx.runtime.sampling import SamplingParams
    g = torch.Generator().manual_seed(2)
    system = torch.randint(3, lm.config.vocab_size, (length,), generator=g).tolist()
    prompts = [system + torch.randint(3, lm.config.vocab_size, (16,), generator=g).tolist() for _ in range(requests)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    rows, copy_min = [], S.COPY_MIN
    engine = Engine(lm.model, max_seq=length + 40, max_batch=requests)
    try:
        for rep in range(repeats + 1):
            for copying in (True, False):
                S.COPY_MIN = copy_min if copying else 10 ** 9
                with S.Scheduler(engine) as sched:
                    sched.kept = [[] for _ in sched.kept]          # nothing kept from the last round
                    first, done, t0 = {}, {}, time.perf_counter()
                    reqs = [sched.submit(p, sp, lambda k, x, i=i: k == "done" and done.setdefault(i, 1))
                            for i, p in enumerate(prompts)]
                    while len(done) < len(reqs):
                        for i, r in enumerate(reqs):
                            if r.tokens and i not in first:
                                first[i] = time.perf_counter() - t0
                        time.sleep(0.002)
                    wall = time.perf_counter() - t0
                if rep:
                    ttft = [first.get(i, wall) for i in range(len(reqs))]
                    rows.append({"system_tokens": length, "requests": requests, "copying": copying,
                                 "cached_tokens": sched.cached_tokens, "ttft_mean_s": round(statistics.mean(ttft), 4),
                                 "ttft_max_s": round(max(ttft), 4), "wall_s": round(wall, 4)})
    finally:
        S.COPY_MIN = copy_min
    return rows


def conversations(lm, count: int, history: int = 256, rows: int = 2, rounds: int = 3) -> list[dict]:
    """COUNT conversations taking turns on ROWS cache rows (one request at a time, as users answering in turn):
    each starts with a HISTORY-token prompt; each next turn re-sends the conversation with the 16 tokens
    generated and 16 new ones. With COUNT kept prefixes (runtime/prefix_store.py) against none: mean time to
    a turn's first token after the first round, and the prompt tokens reused."""
    from kilnx.runtime.engine import Engine
    from kilnx.runtime.sampling import SamplingParams
    from kilnx.runtime.scheduler import Scheduler
    g = torch.Generator().manual_seed(3)
    starts = [torch.randint(3, lm.config.vocab_size, (history,), generator=g).tolist() for _ in range(count)]
    news = [[torch.randint(3, lm.config.vocab_size, (16,), generator=g).tolist() for _ in range(rounds)]
            for _ in range(count)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = Engine(lm.model, max_seq=history + rounds * 32 + 16, max_batch=rows)
    out = []
    for slots in (count, 0, count, 0):
        with Scheduler(engine, prefix_slots=slots) as sched:
            sched.kept = [[] for _ in sched.kept]                  # nothing kept from the last setting
            convs, ttft, cached = [list(s) for s in starts], [], 0
            for r in range(rounds):
                for c in range(count):
                    done, t0 = threading.Event(), time.perf_counter()
                    ends = []
                    req = sched.submit(convs[c], sp, lambda k, x: k == "done" and (ends.append(x), done.set()))
                    while not req.tokens:                          # the first token: poll the request
                        time.sleep(0.0005)
                    first = time.perf_counter() - t0
                    done.wait()
                    fin = ends[0]
                    if r:
                        ttft.append(first)
                        cached += fin.cached_tokens
                    convs[c] += list(fin.token_ids) + news[c][r]
        out.append({"conversations": count, "rows": rows, "history": history, "prefix_slots": slots,
                    "turns_timed": len(ttft), "cached_tokens": cached, "ttft_mean_s": round(statistics.mean(ttft), 4),
                    "ttft_max_s": round(max(ttft), 4)})
    return out


def main(argv):
    from kilnx.models.loaders import load_model
    from kilnx.runtime.device import detect
    args = [a for a in argv if not a.startswith("--")]
    out = args[0]
    model = args[1] if len(args) > 1 else "smollm2-135m"
    batches = [int(b) for b in (args[2] if len(args) > 2 else "1,4,8").split(",")]
    n = int(args[3]) if len(args) > 3 else 8
    tokens = int(args[4]) if len(args) > 4 else 64
    info = detect("auto")
    lm = load_model(model, device=info.torch_device, ops="auto", random="--random" in argv)
    from kilnx.runtime.bench import commit as code_commit
    commit = code_commit()          # KILNX_COMMIT where the driver names it: the device's copy has stale git metadata
    stamp = {"model": model, "device": info.name, "torch": torch.__version__, "commit": commit or "?",
             "date": time.strftime("%Y-%m-%d")}
    if "--system" in argv:
        rows = [{**r, **stamp} for r in shared_system_prompt(lm, int(args[2]) if len(args) > 2 else 512)]
        for r in rows:
            print(r, flush=True)
        return _write(out, rows)
    if "--conversations" in argv:
        rows = [{**r, **stamp} for r in conversations(lm, int(args[2]) if len(args) > 2 else 6)]
        for r in rows:
            print(r, flush=True)
        return _write(out, rows)
    if "--prefix" in argv:
        rows = [{**r, **stamp} for r in prefix_reuse(lm, int(args[2]) if len(args) > 2 else 1024)]
        for r in rows:
            print(r, flush=True)
        return _write(out, rows)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, lm.config.vocab_size, (32,), generator=g).tolist() for _ in range(n)]
    rows = []
    for b in batches:
        r = {**run(lm, b, prompts, tokens), **stamp}
        rows.append(r)
        print(r, flush=True)
    base = next((r["tok_s"] for r in rows if r["max_batch"] == 1), None)
    for r in rows:
        r["speedup_vs_max_batch_1"] = round(r["tok_s"] / base, 3) if base else ""
    _write(out, rows)


def _write(out: str, rows: list[dict]) -> None:
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
