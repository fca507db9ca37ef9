"""Weights pulled into L2 while the GPU's memory would otherwise idle: the short kernels between a decode
step's GEMVs.

Why: a llama decode step alternates memory-bound GEMVs with short kernels that move almost nothing
(add + RMSNorm, attention over a short cache, SwiGLU; ~11 us of a llama-3.1-8b layer's ~58 on the H200),
during which HBM idles. A prefetch kernel launched right after a GEMV asks L2 for the first rows of the
next GEMV's weight (its packed words, scales and biases); those lines stream in over the previous GEMV's
tail and the short kernels, and the next GEMV's first programs, which read the first rows, find them
in L2. The GEMVs read their weights with an evict-first hint, so the lines prefetched for the next one
outlive the stream of the current one.

The kernel only prefetches, so it triggers the next kernel's launch at its top (PDL) and then waits for
the previous kernel: the chain's launches are not delayed, and its completion still implies the previous
kernel's (kd.grid_dependency_sync(next_starts_early=True)).
"""

from __future__ import annotations

import functools
import math
import os

import torch

import kilnx.dsl as kd
from kilnx.dsl.ir import ITEMSIZE

LINE_BYTES = 128
MAX_ROWS = 16          # decode: past this many activation rows the GEMMs are not memory-bound


def _spec(*tensors, **_):
    return None


@kd.kernel(tune={"LINES": kd.pow2(8, 256, default=32), "num_warps": kd.choice(1, 2, 4, default=1)},
           key=lambda a, b, c, **scalars: {"bytes": scalars.get("a_stop", 0) * a.element_size()},
           spec=_spec)
def l2_prefetch_kernel(a, b, c, *, a_stop: int, b_stop: int, c_stop: int, PROGRAMS: kd.constexpr, LINES):
    """Elements [0, stop) of the flat tensors a, b, c into L2, each program a contiguous share of whole
    128-byte lines, LINES lines a step."""
    p = kd.grid(PROGRAMS)
    for t, stop in ((a, a_stop), (b, b_stop), (c, c_stop)):
        per_line = LINE_BYTES // ITEMSIZE[t.dtype]
        span = kd.cdiv(kd.cdiv(stop, PROGRAMS), per_line) * per_line
        start = p * span
        end = kd.minimum(start + span, stop)
        for c0 in kd.range(start, end, per_line * LINES):
            # spare lanes of the last step repeat the program's last line (kd.prefetch has no mask)
            kd.prefetch(t, kd.minimum(c0 + kd.arange(0, LINES) * per_line, end - 1))
    kd.grid_dependency_sync(next_starts_early=True)


@functools.lru_cache(maxsize=None)
def budget_bytes() -> int:
    """Bytes of the next weight to prefetch after each GEMV of a decode step (KILNX_L2_PREFETCH_MB; 0 is off)."""
    return int(float(os.environ.get("KILNX_L2_PREFETCH_MB", "0")) * 2**20)


SITES = ("qkv", "o", "gate_up", "down", "lm_head")


@functools.lru_cache(maxsize=None)
def sites() -> frozenset:
    """The GEMVs whose weights are prefetched (KILNX_L2_PREFETCH_SITES, comma-separated from SITES; all by
    default, "none" for none)."""
    got = os.environ.get("KILNX_L2_PREFETCH_SITES", ",".join(SITES)).replace("none", "")
    chosen = frozenset(s for s in got.split(",") if s)
    if chosen - set(SITES):
        raise ValueError(f"KILNX_L2_PREFETCH_SITES: unknown {sorted(chosen - set(SITES))}; choose from {SITES}")
    return chosen


def _programs(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def prefetch_rows(w, rows: int, *, backend=None, config=None) -> None:
    """Ask L2 for weight rows [0, rows) of an affine QWeight (N, K): its packed words, scales and biases."""
    if w.mode != "affine" or len(w.shape) != 2:
        raise ValueError(f"prefetch_rows takes a 2-d affine QWeight, got {w.mode} {tuple(w.shape)}")
    rows = max(0, min(rows, w.shape[0]))
    packed, scales, biases = (t.reshape(-1) for t in (w.packed, w.scales, w.biases))
    l2_prefetch_kernel(packed, scales, biases, a_stop=rows * w.packed.shape[1], b_stop=rows * w.scales.shape[1],
                       c_stop=rows * w.biases.shape[1], PROGRAMS=_programs(packed.device), backend=backend,
                       config=config)


def prefetch_weights(parts, x, site: str, budget: int | None = None) -> None:
    """kilnx.ops.prefetch_weights: before the short kernels that precede the GEMV of `parts` (decode rows
    only, on a GPU), the first `budget` bytes' worth of rows of each 2-d affine weight in `parts`; `site`
    names the GEMV (one of SITES).
    x: activations (..., K) or a PreparedX, for its device and row count."""
    budget = budget_bytes() if budget is None else budget
    if budget <= 0 or site not in sites() or x.device.type != "cuda" or math.prod(x.shape[:-1]) > MAX_ROWS:
        return
    from kilnx.quant import QWeight
    for w in parts:
        if isinstance(w, QWeight) and w.mode == "affine" and len(w.shape) == 2:
            per_row = w.packed.shape[1] * 4 + (w.scales.shape[1] + w.biases.shape[1]) * w.scales.element_size()
            prefetch_rows(w, budget // per_row)
            budget -= min(budget, per_row * w.shape[0])
            if budget <= 0:
                return
