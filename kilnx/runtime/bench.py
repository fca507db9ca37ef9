"""Benchmark one model: TTFT, prefill tok/s, decode tok/s and % of the memory roofline, per prompt length.

Roofline: a decode step must read every weight byte plus the KV cache of the context once, so its
best possible time is (weight bytes + KV bytes read) / memory bandwidth. Bandwidth is measured as
a large device-to-device torch copy (read + write bytes / time), what a well-written kernel reaches.
"""

from __future__ import annotations

import csv as csv_mod
import dataclasses
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
              bandwidth_gbps: float | None = None, seed: int = 0, repeats: int = 1) -> list[BenchRow]:
    """One row per prompt length; with `repeats` > 1 each figure is the median over that many measured
    runs of the same prompt (a 64-token decode is ~50 ms on a GPU: single runs spread by several percent)."""
    cfg = lm.config
    need = max(prompt_lens) + gen + 1
    if max(prompt_lens) >= cfg.max_position_embeddings:
        raise ContextLengthError(f"prompt length {max(prompt_lens)} does not fit the model's context "
                                 f"({cfg.max_position_embeddings} tokens); use shorter --prompt-lens.")
    engine = Engine(lm.model, max_seq=min(need, cfg.max_position_embeddings))
    device = engine.device
    bw = bandwidth_gbps or copy_bandwidth_gbps(device)
    weight_bytes = lm.model.weights.nbytes()
    kv_per_tok = engine.cache.bytes_per_token()
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=gen, ignore_eos=True)
    # Warm-up: first calls compile kernels and grow allocators; keep that out of the numbers.
    _run(engine, torch.randint(0, cfg.vocab_size, (min(16, max(prompt_lens)),), generator=g).tolist(),
         SamplingParams(max_tokens=min(4, gen), ignore_eos=True))
    rows = []
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    for L in prompt_lens:
        ids = torch.randint(0, cfg.vocab_size, (L,), generator=g).tolist()
        # each prompt length runs once unmeasured: its prefill chunk shapes may pick kernel configs
        # (and so compiles) the short warm-up never touched
        _run(engine, ids, SamplingParams(max_tokens=2, ignore_eos=True))
        st = median_stats([_run(engine, ids, params) for _ in range(max(1, repeats))])
        # Average context over the decode steps: each step reads all keys and values written so far.
        kv_read = int(kv_per_tok * (L + gen / 2))
        per_token = weight_bytes + kv_read
        ideal_tok_s = bw * 1e9 / per_token
        rows.append(BenchRow(
            model=model_name, device=str(device), ops=ops_name, weights=weights, prompt_len=L, gen=gen,
            ttft_ms=st.ttft_s * 1e3, prefill_tok_s=st.prefill_tok_s, decode_tok_s=st.decode_tok_s,
            weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_tok, bytes_per_decode_token=per_token,
            copy_bandwidth_gbps=bw, roofline_pct=100.0 * st.decode_tok_s / ideal_tok_s, timestamp=stamp))
    return rows


def median_stats(runs: list) -> GenerationStats:
    """The runs' median TTFT, prefill and decode rates (each figure's own median)."""
    med = statistics.median
    return dataclasses.replace(runs[0], ttft_s=med([r.ttft_s for r in runs]),
                               prefill_tok_s=med([r.prefill_tok_s for r in runs]),
                               decode_tok_s=med([r.decode_tok_s for r in runs]))


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
