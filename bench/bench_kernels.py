"""Kernel benchmarks: kilnx against its peers measured in the same run, written as CSV.

    python bench/bench_kernels.py --out DIR [--suite fusions,quant,moe] [--smoke]

Every timing is a CUDA graph replaying the kernel over enough distinct input copies that they do
not fit in L2 (so the weights really stream from HBM), divided by the number of calls; peers
(torch eager, torch.compile, cuBLAS bf16 on the dequantized weight, the HBM copy) are timed the
same way in the same process. `--smoke` runs tiny shapes on the CPU/interpreter to check the script.
Columns: suite,case,metric,value,peer,peer_value,device,torch,triton,commit,date.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kilnx.kernels import activations, norms  # noqa: E402

L2_BYTES = 60 << 20
QUICK = False
COLUMNS = ["suite", "case", "metric", "value", "peer", "peer_value", "device", "torch", "triton", "commit", "date"]


class Recorder:
    def __init__(self, path: str):
        self.path = path
        from kilnx.runtime.bench import provenance
        p = provenance("cuda" if torch.cuda.is_available() else "cpu")
        self.meta = {"device": p.pop("gpu"), **p}
        self.rows = []

    def add(self, suite, case, metric, value, peer="", peer_value=""):
        row = {"suite": suite, "case": case, "metric": metric, "value": _fmt(value), "peer": peer,
               "peer_value": _fmt(peer_value), **self.meta}
        self.rows.append(row)
        print(f"{suite:8s} {case:40s} {metric:22s} {_fmt(value):>10s}  {peer} {_fmt(peer_value)}", flush=True)
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, COLUMNS)
            w.writeheader()
            w.writerows(self.rows)


def device_tag() -> str:
    """The GPU's short name for file names ("h100", "h200"; "cpu" without one): the files were all named h200 until
    session 38, whose H100 call wrote a file so named."""
    if not torch.cuda.is_available():
        return "cpu"
    words = torch.cuda.get_device_name().lower().replace("nvidia", "").split()
    return next((w for w in words if any(c.isdigit() for c in w)), words[0] if words else "gpu")


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def time_calls(fn, arg_sets, reps: int = 20) -> float:
    """Median seconds per call of fn over rotating arg sets, replayed in a CUDA graph."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for a in arg_sets:
            fn(*a)
        return (time.perf_counter() - t) / len(arg_sets)
    for a in arg_sets:   # warm-up compiles outside the graph
        fn(*a)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            for a in arg_sets:
                fn(*a)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3 / len(arg_sets))
    times.sort()
    return times[len(times) // 2]


def time_paths(case: str, paths: dict, want, rounds: int, peers: tuple[str, ...] = ()) -> list[dict]:
    """Probe rows {case, path, round, us}: each path is (fn, arg sets). Every path but the `peers` is first run
    on its first arg set against `want` (a relative error of 3% or more, or an exception, leaves it out,
    reported), then all are timed in turn, `rounds` times, by time_calls."""
    ok = {}
    for path, (fn, args) in paths.items():
        try:
            if path not in peers:
                err = (fn(*args[0]).float() - want).abs().max().item() / want.abs().max().item()
                assert err < 3e-2, f"relative error {err:.3g}"
            ok[path] = True
        except Exception as e:  # noqa: BLE001 - a config that does not compile or is wrong is reported, not fatal
            print(f"{case} {path}: {e!r}"[:300], flush=True)
            ok[path] = False
    rows = []
    for r in range(rounds):
        for path, (fn, args) in paths.items():
            if ok[path]:
                rows.append({"case": case, "path": path, "round": r, "us": round(time_calls(fn, args, reps=10) * 1e6, 2)})
                print(rows[-1], flush=True)
    return rows


def write_probe_csv(out: str, rows: list[dict], device: str) -> None:
    """A probe's rows with the run's provenance (device, versions, commit, date) on each."""
    from kilnx.runtime.bench import provenance
    stamp = provenance(device)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]) + list(stamp))
        w.writeheader()
        w.writerows({**r, **stamp} for r in rows)


def copies_for(nbytes: int, smoke: bool) -> int:
    return 2 if smoke else max(2, min(64, (4 * L2_BYTES) // max(nbytes, 1) + 1))


def copy_bandwidth(rec: Recorder, smoke: bool) -> float:
    """copy_gbps, recorded as the run's copy ceiling."""
    bw = copy_gbps(smoke)
    rec.add("copy", "copy_2GiB_bf16", "GBps", bw)
    return bw


def copy_gbps(smoke: bool = False) -> float:
    """Device-to-device copy of 2 GiB (bytes read + written), timed with events around plain copies:
    a copy captured in a CUDA graph measured only ~65% of this on the H200."""
    n = (1 << 20) if smoke else (1 << 30)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(7):
        if dev == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            b.copy_(a)
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        else:
            t = time.perf_counter()
            b.copy_(a)
            times.append(time.perf_counter() - t)
    t = sorted(times)[len(times) // 2]
    bw = 2 * a.numel() * a.element_size() / t / 1e9
    del a, b
    return bw


def bench_fusions(rec: Recorder, copy_bw: float, smoke: bool):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16
    cases = [("add_rms_norm", 4096), ("rms_norm", 4096), ("silu_mul", 14336), ("gelu_tanh_mul", 14336)]
    rows_list = ([4096] if QUICK else [1, 16, 4096]) if not smoke else [1, 3]
    for name, width in cases:
        if smoke:
            width = 256
        for rows in rows_list:
            case = f"{name}_{rows}x{width}"
            try:
                _bench_one_fusion(rec, name, rows, width, dt, dev, copy_bw, smoke, case)
            except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
                rec.add("fusions", case, "error", repr(e)[:200])
                traceback.print_exc()


def _fusion_setup(name, rows, width, dt, dev):
    def mk(*shape):
        return torch.randn(*shape, dtype=dt, device=dev)
    if name == "add_rms_norm":
        args = (mk(rows, width), mk(rows, width), mk(width))
        kern = lambda x, r, w: norms.add_rms_norm(x, r, w, 1e-6)  # noqa: E731
        eager = lambda x, r, w: _eager_add_rms(x, r, w)  # noqa: E731
        nbytes = 4 * rows * width * 2 + width * 2
    elif name == "rms_norm":
        args = (mk(rows, width), mk(width))
        kern = lambda x, w: norms.rms_norm(x, w, 1e-6)  # noqa: E731
        eager = lambda x, w: _eager_rms(x, w)  # noqa: E731
        nbytes = 2 * rows * width * 2 + width * 2
    else:
        args = (mk(rows, 2 * width),)
        kern = activations.silu_mul if name == "silu_mul" else activations.gelu_tanh_mul
        eager = _eager_silu_mul if name == "silu_mul" else _eager_gelu_mul
        nbytes = 3 * rows * width * 2
    return args, kern, eager, nbytes


def _bench_one_fusion(rec, name, rows, width, dt, dev, copy_bw, smoke, case):
    args, kern, eager, nbytes = _fusion_setup(name, rows, width, dt, dev)
    n = copies_for(nbytes, smoke)
    sets = [tuple(a.clone() for a in args) for _ in range(n)]
    t_k = time_calls(kern, sets)
    t_e = time_calls(eager, sets)
    rec.add("fusions", case, "GBps", nbytes / t_k / 1e9, "torch_eager", nbytes / t_e / 1e9)
    rec.add("fusions", case, "pct_of_copy", 100 * nbytes / t_k / 1e9 / copy_bw, "copy_GBps", copy_bw)
    rec.add("fusions", case, "us", t_k * 1e6, "torch_eager_us", t_e * 1e6)
    if torch.cuda.is_available() and rows == 4096 and name in ("add_rms_norm", "silu_mul") and not smoke and not QUICK:
        comp = torch.compile(eager, dynamic=False)
        t_c = time_calls(comp, sets)
        rec.add("fusions", case, "GBps_vs_compile", nbytes / t_k / 1e9, "torch_compile", nbytes / t_c / 1e9)


def _eager_rms(x, w):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)


def _eager_add_rms(x, r, w):
    h = x.float() + r.float()
    return h.to(x.dtype), (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)


def _eager_silu_mul(gu):
    g, u = gu.float().chunk(2, -1)
    return (torch.nn.functional.silu(g) * u).to(gu.dtype)


def _eager_gelu_mul(gu):
    g, u = gu.float().chunk(2, -1)
    return (torch.nn.functional.gelu(g, approximate="tanh") * u).to(gu.dtype)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--suite", default="fusions,quant")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--quick", action="store_true", help="fusions at 4096 rows only")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    date = datetime.date.today().isoformat()
    for suite in a.suite.split(","):
        rec = Recorder(os.path.join(a.out, f"{date}_{device_tag()}_{suite}.csv"))
        bw = copy_bandwidth(rec, a.smoke)
        if a.quick:
            global QUICK
            QUICK = True
        if suite == "quant":
            from bench_quant import bench_quant
            bench_quant(rec, bw, a.smoke)
        elif suite == "moe":
            from bench_moe import bench_moe
            bench_moe(rec, bw, a.smoke)
        else:
            {"fusions": bench_fusions}[suite](rec, bw, a.smoke)


if __name__ == "__main__":
    main()
