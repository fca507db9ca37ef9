"""Host time of kilnx's own launch path (dispatch, memo lookups, output allocation, argument list), with
the Triton launch itself stubbed out: general path against the prepared call (launch._TritonCall).

    TRITON_INTERPRET=1 python bench/probes/launch_overhead.py [CALLS]

Runs on the CPU (the interpreter's backend is "triton"; the stub never runs a kernel). Prints microseconds
per call for a few library kernels at their first tuning problem. Triton's own launcher comes on top in
real use (at most ~66 us a call over ~1150 calls of a cold start on the H200 host, bench/probes/
cold_phases.py). Figures moved by up to 2x between runs on a shared 2-core machine.
"""

from __future__ import annotations

import sys
import time

import torch

from kilnx.codegen import launch as L

KERNELS = [("kilnx.kernels.norms", "add_rms_norm_kernel"), ("kilnx.kernels.activations", "silu_mul_kernel"),
           ("kilnx.kernels.qmatmul", "qmm"), ("kilnx.kernels.qmv_h2", "qmv_h2"), ("kilnx.kernels.dense_mm", "mm"),
           ("kilnx.kernels.attention", "attention_kernel")]


class _Stub:
    def __getitem__(self, grid):
        return lambda *a, **k: None


def per_call_us(kernel, args, calls: int) -> float:
    kernel._calls.clear()
    kernel(*args)                          # builds (the stub is put in below) and remembers the call
    for launch in kernel._compiled.values():
        launch.fn = _Stub()
    kernel._calls.clear()
    kernel(*args)
    t = time.perf_counter()
    for _ in range(calls):
        kernel(*args)
    return (time.perf_counter() - t) / calls * 1e6


def main():
    import importlib
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    for module, name in KERNELS:
        kernel = getattr(importlib.import_module(module), name, None)
        if kernel is None or kernel.make_args is None:
            print(f"{name}: not found")
            continue
        problem = kernel.sample_problems()[0]
        args = kernel.make_args(problem, "cpu")
        for launch in kernel._compiled.values():
            launch.fn = _Stub()
        kernel._compiled.clear()
        prepared = per_call_us(kernel, args, calls)
        original = L.Launch.prepared
        L.Launch.prepared = lambda self, *a: None if self.backend == "triton" else original(self, *a)
        try:
            kernel._compiled.clear()
            general = per_call_us(kernel, args, calls)
        finally:
            L.Launch.prepared = original
        print(f"{name:22s} {problem}: general {general:6.1f} us, prepared {prepared:6.1f} us per call")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
