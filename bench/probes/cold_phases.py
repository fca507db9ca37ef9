"""Where a new process's first token waits, without a profiler's overhead: wall-clock totals of the calls
on the cold path (kernel builds, Triton's compile/cache loads and launches, the warm-up thread and the
wait for it, graph capture and instantiation, each model forward), for one cold start.

    python bench/probes/cold_phases.py OUT_CSV [--model llama-3.1-8b]

Run after bench/cold_first_token.py has filled the caches. Totals are inclusive (a build's time contains
its module load), measured by wrapping the functions. CSV rows: kind, name, seconds, detail, then the GPU,
torch, triton, commit (KILNX_COMMIT) and date.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import collections  # noqa: E402
import csv  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402

ACC: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, None])   # label -> calls, seconds, first start


def timed(owner, name: str, label: str, split_first: bool = False) -> None:
    """Wrap owner.name; with split_first, a method's first call on each object counts apart (label + " first")."""
    f = getattr(owner, name)
    seen: set[int] = set()

    @functools.wraps(f)
    def wrapper(*a, **k):
        t = time.perf_counter()
        first = split_first and a and id(a[0]) not in seen
        if first:
            seen.add(id(a[0]))
        try:
            return f(*a, **k)
        finally:
            d = ACC[label + (" first" if first else "")]
            d[0] += 1
            d[1] += time.perf_counter() - t
            if d[2] is None:
                d[2] = t - T0
    setattr(owner, name, wrapper)


def main():
    out = sys.argv[1]
    model = sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else "llama-3.1-8b"
    import torch
    torch.cuda.init()
    phases = {"import_torch_cuda_init": time.perf_counter() - T0}
    import torch.cuda.graphs as G
    from triton.runtime import jit
    timed(gc, "collect", "gc.collect")
    timed(torch.cuda, "synchronize", "torch.cuda.synchronize")
    timed(G.graph, "__enter__", "graph.__enter__")
    timed(G.graph, "__exit__", "graph.__exit__")
    timed(G.CUDAGraph, "capture_end", "CUDAGraph.capture_end")
    timed(jit.JITFunction, "run", "triton.JITFunction.run", split_first=True)
    timed(jit.JITFunction, "_do_compile", "triton.JITFunction._do_compile")
    from kilnx.codegen import launch as L
    import importlib
    K = importlib.import_module("kilnx.dsl.kernel")
    timed(L, "_join_warm_up", "kilnx.join_warm_up (main thread waits)")
    timed(L, "_warm", "kilnx.warm_up thread")
    timed(L, "load_module", "kilnx.load_module")
    timed(L.Launch, "__call__", "kilnx.Launch.__call__", split_first=True)
    timed(K.TileKernel, "_build", "kilnx.TileKernel._build")
    timed(K.KernelBase, "_tuned_config", "kilnx._tuned_config")
    from kilnx.models.loaders import load_model
    from kilnx.runtime.engine import Engine
    from kilnx.runtime.generate import generate_ids
    from kilnx.runtime.sampling import SamplingParams
    timed(Engine, "_capture", "engine._capture (decode graph)")
    timed(Engine, "_prefill_graphed", "engine._prefill_graphed")
    phases["import_kilnx"] = time.perf_counter() - T0
    lm = load_model(model, device=torch.device("cuda"), random=True, random_format="q4")
    torch.cuda.synchronize()
    phases["load_model"] = time.perf_counter() - T0
    timed(lm.model, "forward", "model.forward")
    engine = Engine(lm.model, max_seq=64)
    torch.cuda.synchronize()
    phases["engine_graph_capture"] = time.perf_counter() - T0
    n = 0
    for item in generate_ids(engine, list(range(1, 9)), SamplingParams(max_tokens=2, ignore_eos=True)):
        if isinstance(item, int):
            torch.cuda.synchronize()
            n += 1
            phases["first_token" if n == 1 else "second_token"] = time.perf_counter() - T0
            if n == 2:
                break
    rows = [("phase", k, v, "") for k, v in phases.items()]
    rows += [("call", k, d[1], f"{d[0]} calls, first at {d[2]:.3f}") for k, d in sorted(ACC.items())]
    from kilnx.runtime.bench import provenance
    prov = provenance("cuda")
    with open(out, "a", newline="") as f:
        w = csv.writer(f)
        for r in rows:
            w.writerow([*r, prov["gpu"], prov["torch"], prov["triton"], prov["commit"], prov["date"]])
    for kind, k, v, extra in rows:
        print(f"{kind:5s} {k:45s} {v:7.3f} s  {extra}")


if __name__ == "__main__":
    main()
