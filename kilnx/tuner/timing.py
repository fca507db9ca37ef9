"""Timing kernels honestly.

GPU: each repeat flushes L2 (by writing a buffer larger than it) and then replays a CUDA graph of one
launch between two CUDA events, so launch overhead from Python does not hide a microsecond kernel and
no repeat benefits from data a previous repeat left in cache. If graph capture fails (some kernels
allocate or synchronise), plain launches are timed the same way. The median of the repeats is used:
one preempted repeat must not decide a winner.

CPU: time.perf_counter around each call after warm-up, median of repeats.

`rerank_interleaved` re-times the finalists in rotating order over several rounds, so slow drift of
the machine (clocks, other tenants) hits every finalist alike instead of favouring whoever ran first.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

Fn = Callable[[], Any]

# CPU defaults: enough repeats for a stable median of a microsecond call without a long trial.
_CPU_WARMUP = 3
_CPU_MIN_REPEATS = 5
_CPU_MAX_REPEATS = 200
_CPU_TARGET_S = 0.05  # stop repeating once this much time has been measured

_GPU_WARMUP = 3
_GPU_REPEATS = 25


def _is_cuda(device: Any) -> bool:
    return str(getattr(device, "torch_device", device)).startswith("cuda")


def benchmark(fn: Fn, device: Any = "cpu", *, repeats: int | None = None, warmup: int | None = None) -> float:
    """Median seconds of one call of `fn()` on `device` (a torch device string or a DeviceInfo)."""
    if _is_cuda(device):
        return _benchmark_cuda(fn, str(getattr(device, "torch_device", device)), repeats or _GPU_REPEATS,
                               _GPU_WARMUP if warmup is None else warmup)
    return _benchmark_cpu(fn, repeats, _CPU_WARMUP if warmup is None else warmup)


def rerank_interleaved(fns: Sequence[Fn], device: Any = "cpu", rounds: int = 5,
                       repeats_per_round: int | None = None) -> list[float]:
    """Median seconds per fn, measured in `rounds` rotating passes over all of them."""
    n = len(fns)
    samples: list[list[float]] = [[] for _ in range(n)]
    per_round = repeats_per_round or (7 if _is_cuda(device) else 5)
    for r in range(rounds):
        for j in range(n):
            i = (j + r) % n  # rotate so no fn always runs first (or right after a given other)
            samples[i].append(benchmark(fns[i], device, repeats=per_round, warmup=1))
    return [statistics.median(s) for s in samples]


def _benchmark_cpu(fn: Fn, repeats: int | None, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times: list[float] = []
    spent = 0.0
    limit = repeats or _CPU_MAX_REPEATS
    minimum = repeats or _CPU_MIN_REPEATS
    while len(times) < limit and (len(times) < minimum or spent < _CPU_TARGET_S):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return statistics.median(times)


class _L2Flusher:
    """A buffer twice the L2 size; writing it evicts whatever a kernel left in L2."""

    _buffers: dict[str, Any] = {}

    @classmethod
    def flush(cls, device: str) -> None:
        import torch
        buf = cls._buffers.get(device)
        if buf is None:
            props = torch.cuda.get_device_properties(torch.device(device))
            l2 = int(getattr(props, "L2_cache_size", 0) or 64 << 20)
            buf = cls._buffers[device] = torch.empty(2 * l2, dtype=torch.uint8, device=device)
        buf.fill_(1)


def _capture_graph(fn: Fn, device: str):
    """A CUDA graph of one `fn()` call, or None when the kernel cannot be captured."""
    import torch
    try:
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()  # a warm-up on the side stream, as capture requires
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize(device)
        return graph
    except Exception:  # noqa: BLE001 - any capture failure means: time plain launches instead
        torch.cuda.synchronize(device)
        return None


def _benchmark_cuda(fn: Fn, device: str, repeats: int, warmup: int) -> float:
    import torch
    with torch.cuda.device(torch.device(device)):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(device)
        graph = _capture_graph(fn, device)
        launch = graph.replay if graph is not None else fn
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for i in range(repeats):
            _L2Flusher.flush(device)
            starts[i].record()
            launch()
            ends[i].record()
        torch.cuda.synchronize(device)
        ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        del graph
    return statistics.median(ms) / 1e3
