"""Benchmark one model: TTFT, prefill tok/s, decode tok/s and % of the memory roofline, per prompt length.

Roofline: a decode step must read every weight byte plus the KV cache of the context once, so its
best possible time is (weight bytes + KV bytes read) / memory bandwidth. Bandwidth is measured as
a large device-to-device torch copy (read + write bytes / time), what a well-written kernel reaches.
"""

from __future__ import annotations

import csv as csv_mod
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from kilnx.models.errors import ContextLengthError
from kilnx.runtime.engine import Engine
from kilnx.runtime.generate import GenerationStats, generate_ids
from kilnx.runtime.sampling import SamplingParams


@dataclass
class BenchRow:
    model: str
    device: str
    ops: str
    weights: str
    prompt_len: int
    gen: int
    ttft_ms: float
    prefill_tok_s: float
    decode_tok_s: float
    weight_bytes: int
    kv_bytes_per_token: int
    bytes_per_decode_token: int
    copy_bandwidth_gbps: float
    roofline_pct: float
    timestamp: str = ""
    batch: int = 1


def copy_bandwidth_gbps(device: torch.device, nbytes: int | None = None, iters: int = 5) -> float:
    """Achieved bandwidth of a large tensor copy on `device`, counting bytes read plus bytes written."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)                       # warm-up: page faults, allocator, clocks
    _sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    elapsed = time.perf_counter() - t
    del src, dst
    return 2 * nbytes * iters / elapsed / 1e9


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def weights_label(lm, random: bool, random_format: str) -> str:
    if random:
        return f"random-{random_format}"
    return os.path.basename(lm.source.rstrip("/"))


def run_bench(lm, *, prompt_lens: list[int], gen: int, model_name: str, weights: str, ops_name: str,
              bandwidth_gbps: float | None = None, seed: int = 0, repeats: int = 1, batch: int = 1,
              kv_cache_dtype: str = "auto") -> list[BenchRow]:
    """kilnx's rows: one per prompt length, timed by `timed_rows`; with `batch` B > 1, B sequences of that
    length decode together (`batched_greedy`)."""
    cfg = lm.config
    if max(prompt_lens) >= cfg.max_position_embeddings:
        raise ContextLengthError(f"prompt length {max(prompt_lens)} does not fit the model's context "
                                 f"({cfg.max_position_embeddings} tokens); use shorter --prompt-lens.")
    # one engine per prompt length, its cache sized as `kilnx generate` sizes it (prompt + tokens + 1): a
    # short prompt's row measures a short cache, not one sized for the longest prompt of the run (decode
    # attention's work, and its split into key ranges, follow the cache's length)
    engines: dict[int, Engine] = {}

    def engine_for(n: int) -> Engine:
        L = min((p for p in prompt_lens if p >= n), default=max(prompt_lens))
        if L not in engines:
            engines[L] = Engine(lm.model, max_seq=min(L + gen + 1, cfg.max_position_embeddings), max_batch=batch,
                                kv_cache_dtype=kv_cache_dtype)
        return engines[L]

    def greedy(ids: list[int], tokens: int) -> tuple[float, float]:
        if batch > 1:
            return batched_greedy(engine_for(len(ids)), [ids[i:] + ids[:i] for i in range(batch)], tokens)[:2]
        st = _run(engine_for(len(ids)), ids, SamplingParams(max_tokens=tokens, ignore_eos=True))
        return st.ttft_s, st.decode_tok_s

    engine = engine_for(max(prompt_lens))

    return timed_rows(greedy, vocab_size=cfg.vocab_size, prompt_lens=prompt_lens, gen=gen, seed=seed,
                      repeats=repeats, model=model_name, device=str(engine.device), ops=ops_name, weights=weights,
                      weight_bytes=lm.model.weights.nbytes(_experts_read_per_token(cfg)),
                      kv_bytes_per_token=engine.cache.bytes_per_token(),
                      # a hybrid model's step reads and writes each row's recurrent state, whatever the context
                      state_bytes_per_token=2 * getattr(engine.cache, "state_nbytes_per_row", 0),
                      bandwidth_gbps=bandwidth_gbps or copy_bandwidth_gbps(engine.device), batch=batch)


def batched_greedy(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[float, float, list[list[int]]]:
    """Greedy decoding of len(prompts) equal-length prompts together, one cache row each: every prompt
    prefilled into its row, then `tokens` - 1 decode steps of all rows at once (the engine's graph of that
    batch). Returns (seconds to every row's first token, decode tok/s summed over the rows, the tokens)."""
    B, L = len(prompts), len(prompts[0])
    if any(len(p) != L for p in prompts):
        raise ValueError("batched_greedy takes prompts of one length")
    engine.check_fits(L + tokens)
    engine.synchronize()
    t0 = time.perf_counter()
    first = torch.stack([engine.prefill(p, row=r).argmax(-1) for r, p in enumerate(prompts)])
    out = [first.tolist()]
    engine.synchronize()
    ttft = time.perf_counter() - t0
    nxt, positions = first.to(engine.device), torch.full((B,), L, dtype=torch.long, device=engine.device)
    t1 = time.perf_counter()
    for i in range(tokens - 1):
        nxt = engine.decode(nxt, positions + i, max_position=L + i).argmax(-1)
        out.append(nxt)
    engine.synchronize()
    seconds = time.perf_counter() - t1
    rows = torch.stack([torch.as_tensor(t, device="cpu") for t in out], dim=1)
    return ttft, B * (tokens - 1) / seconds if tokens > 1 else 0.0, rows.tolist()


def _experts_read_per_token(cfg) -> float:
    """The fraction of an MoE model's expert weights one decode step reads (its top_k of E experts)."""
    return cfg.num_experts_per_tok / cfg.num_experts if cfg.is_moe else 1.0


def timed_rows(greedy, *, vocab_size: int, prompt_lens: list[int], gen: int, seed: int, repeats: int,
               model: str, device: str, ops: str, weights: str, weight_bytes: int, kv_bytes_per_token: int,
               bandwidth_gbps: float, batch: int = 1, state_bytes_per_token: int = 0) -> list[BenchRow]:
    """The protocol kilnx and every peer are timed by, so their rows compare: `greedy(ids, n)` generates
    n tokens after prompt ids and returns (TTFT seconds, decode tok/s over the tokens after the first).
    Prompts come from one seeded generator in one order (a warm-up prompt, then one per length); each
    length runs once unmeasured (its prefill shapes may compile what the warm-up did not), then `repeats`
    times, each figure the median (a 64-token decode is ~50 ms on a GPU: single runs spread by several
    percent)."""
    g = torch.Generator().manual_seed(seed)
    greedy(torch.randint(0, vocab_size, (min(16, max(prompt_lens)),), generator=g).tolist(), min(4, gen))
    rows, stamp = [], time.strftime("%Y-%m-%dT%H:%M:%S")
    for L in prompt_lens:
        ids = torch.randint(0, vocab_size, (L,), generator=g).tolist()
        greedy(ids, 2)
        runs = [greedy(ids, gen) for _ in range(max(1, repeats))]
        ttft, decode = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        # Average context over the decode steps: each step reads all keys and values written so far; a step
        # of B rows reads the weights once for B tokens
        per_token = weight_bytes // batch + int(kv_bytes_per_token * (L + gen / 2)) + state_bytes_per_token
        rows.append(BenchRow(
            model=model, device=device, ops=ops, weights=weights, prompt_len=L, gen=gen, ttft_ms=ttft * 1e3,
            prefill_tok_s=batch * L / ttft, decode_tok_s=decode, weight_bytes=weight_bytes,
            kv_bytes_per_token=kv_bytes_per_token, bytes_per_decode_token=per_token, copy_bandwidth_gbps=bandwidth_gbps,
            roofline_pct=100.0 * decode * per_token / (bandwidth_gbps * 1e9), timestamp=stamp, batch=batch))
    return rows


def _run(engine: Engine, ids: list[int], params: SamplingParams) -> GenerationStats:
    stats = None
    for item in generate_ids(engine, ids, params):
        if isinstance(item, GenerationStats):
            stats = item
    return stats


def commit() -> str:
    """The code's commit. A copy of the tree may carry an older checkout's git metadata (the device
    machine's does): the commit the driver script names in KILNX_COMMIT wins over `git rev-parse`."""
    import subprocess
    named = os.environ.get("KILNX_COMMIT", "unknown")
    if named not in ("", "unknown"):
        return named
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


def provenance(device) -> dict:
    """What a result row needs to be read later: the device's name, library versions, commit, date."""
    import datetime

    import triton
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"gpu": name, "torch": torch.__version__, "triton": triton.__version__, "commit": commit(),
            "date": datetime.date.today().isoformat()}


def append_csv(path: str, rows: list[BenchRow]) -> None:
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    extra = provenance(rows[0].device) if rows else {}
    fields = list(asdict(rows[0]).keys()) + list(extra) if rows else []
    with open(path, "a", newline="") as f:
        w = csv_mod.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({**asdict(r), **extra})
