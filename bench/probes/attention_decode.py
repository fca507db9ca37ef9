"""Decode attention configs at llama-3.1-8b heads (B 1, Hq 32, Hk 8, D 128, bf16), one new token:
the one-program kernel (attention_kernel) and the key-range split (attention_split_kernel + the merge
that writes the o projection's prepared input) over a sweep of their configs, at a short context in a
256-slot cache (what `kilnx bench` decodes after a 128-token prompt) and a 2k context in a 2113-slot one.

  GPU:  python bench/probes/attention_decode.py OUT_CSV
        python bench/probes/attention_decode.py OUT_CSV kv   (the route as it runs, default configs, over a bf16 and
                                                              an fp8 cache at 256 / 2113 / 8256 slots)
        python bench/probes/attention_decode.py OUT_CSV long|warps   (the split's configs at 8k / 32k keys; its warps)
        python bench/probes/attention_decode.py OUT_CSV merge   (the split and the prepared merge timed apart)
Timing: kilnx.tuner.timing.benchmark (CUDA-graph replays, L2 flushed between, median).
"""
from __future__ import annotations

import csv
import itertools
import sys

import torch

from kilnx.kernels import attention as A
from kilnx.kernels import attention_split as AS
from kilnx.tuner.timing import benchmark

CASES = [(130, 256), (190, 256), (2050, 2113)]      # (context incl. the new token, cache slots)
PREP = AS.TUNING_PREPARED                           # the o projection's prepared format (4-bit, group 64)
# llama-3.1-8b's attention arguments (scale; no softcap, no window)
KW = A._kernel_kwargs(q=torch.empty(1, 1, 32, 128), k_cache=torch.empty(1, 8, 1, 128), scale=128 ** -0.5, softcap=None,
                      window=None)


def inputs(ctx: int, S: int):
    torch.manual_seed(0)
    q = torch.randn(1, 1, 32, 128, device="cuda").bfloat16()
    k = torch.randn(1, 8, S, 128, device="cuda").bfloat16()
    v = torch.randn(1, 8, S, 128, device="cuda").bfloat16()
    pos = torch.full((1, 1), ctx - 1, dtype=torch.int32, device="cuda")
    return q, k, v, pos


def one_program(q, k, v, pos, kw, cfg):
    from kilnx.kernels.prepared import prepare
    out = A.attention_kernel(q, k, v, pos, config=cfg, **kw)
    return prepare(out.reshape(1, 32 * 128), PREP)


def split(q, k, v, pos, kw, cfg):
    return AS.attention_split(q, k, v, pos, kw, config=cfg, prepared=PREP)


def timed(fn) -> tuple[str, str]:
    """(us, "") for fn run once then benchmarked, or ("", the error) for a config the compiler refuses (shared
    memory, registers): recorded, not fatal."""
    try:
        fn()
        return f"{benchmark(fn, 'cuda') * 1e6:.2f}", ""
    except Exception as e:   # noqa: BLE001
        return "", f"{type(e).__name__}: {str(e)[:80]}"


def main(path: str):
    rows = []
    for ctx, S in CASES:
        q, k, v, pos = inputs(ctx, S)
        trials = [("one_program", c) for c in
                  ({"BLOCK_M": 16, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
                   for bn, w, st in itertools.product((32, 64, 128, 256), (4, 8), (1, 2, 3)))]
        trials += [("split", c) for c in
                   ({"BLOCK_M": 16, "BLOCK_N": bn, "KEYS_PER_SPLIT": ks, "num_warps": w, "num_stages": st}
                    for ks, bn, w, st in itertools.product((64, 128, 256, 512), (64, 128), (4, 8), (1, 2))
                    if bn <= ks and S // ks <= 128)]
        for path_name, cfg in trials:
            fn = one_program if path_name == "one_program" else split
            us, error = timed(lambda: fn(q, k, v, pos, KW, cfg))
            rows.append([ctx, S, path_name, cfg, us, error])
            if us:
                print(ctx, S, path_name, cfg, f"{us} us", flush=True)
    write_csv(path, ["ctx", "cache", "path", "config", "us", "error"], rows)
    for ctx, S in CASES:
        for p in ("one_program", "split"):
            ok = [r for r in rows if r[0] == ctx and r[2] == p and r[4]]
            if ok:
                best = min(ok, key=lambda r: float(r[4]))
                print(f"best {p} ctx {ctx} cache {S}: {best[4]} us {best[3]}")


def write_csv(path: str, header: list[str], rows: list[list]) -> None:
    """rows under header, each stamped with the device, versions, commit and date."""
    import datetime
    import os

    import triton
    stamp = [torch.cuda.get_device_name(), torch.__version__, triton.__version__,
             os.environ.get("KILNX_COMMIT", "unknown"), datetime.date.today().isoformat()]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header + ["device", "torch", "triton", "commit", "date"])
        w.writerows(r + stamp for r in rows)


def kv_dtypes(path: str):
    """ops.attention (split or not, as the decode step chooses, with the o projection's prepared input) on each
    cache dtype: what --kv-cache-dtype fp8 changes in the kernels alone, the bytes they stream halved."""
    rows = []
    for ctx, S in ((130, 256), (2050, 2113), (8193, 8256), (32769, 32832)):
        q, k, v, pos = inputs(ctx, S)
        for kv in ("bf16", "fp8"):
            kc, vc = (k, v) if kv == "bf16" else (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn))
            fn = lambda: A.attention(q, kc, vc, pos, 128 ** -0.5, prepared=PREP)   # noqa: E731
            fn()
            us = benchmark(fn, "cuda") * 1e6
            gbps = 2 * 8 * ctx * 128 * kc.element_size() / us / 1e3
            rows.append([ctx, S, kv, "split" if AS.use_split(q, kc) else "one_program", f"{us:.2f}", f"{gbps:.0f}"])
            print(*rows[-1], flush=True)
    write_csv(path, ["ctx", "cache", "kv", "path", "us", "kv_GBps"], rows)


def long_contexts(path: str):
    """The split kernel's configs at long contexts (8k and 32k keys) on a bf16 and an fp8 cache: whether the
    default (ranges sized so the programs number about the SMs) streams K and V near the copy ceiling."""
    sweeps = {(8193, 8256): ((128, 256, 512, 1024), (32, 64, 128), (4, 8), (2, 3, 4)),
              (32769, 32832): ((512, 1024, 2048), (64, 128), (4, 8), (2, 3))}
    rows = []
    for (ctx, S), grid in sweeps.items():
        q, k, v, pos = inputs(ctx, S)
        for kv in ("bf16", "fp8"):
            kc, vc = (k, v) if kv == "bf16" else (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn))
            default = AS.attention_split_kernel.default_config(q, kc, vc, pos, **KW)
            trials = [("default", None)] + [("sweep", {"BLOCK_M": 16, "BLOCK_N": bn, "KEYS_PER_SPLIT": ks,
                                                       "num_warps": w, "num_stages": st})
                                            for ks, bn, w, st in itertools.product(*grid) if bn <= ks]
            for name, cfg in trials:
                us, error = timed(lambda: split(q, kc, vc, pos, KW, cfg))
                gbps = f"{2 * 8 * ctx * 128 * kc.element_size() / float(us) / 1e3:.0f}" if us else ""
                rows.append([ctx, S, kv, name, cfg or default, us, gbps, error])
            ok = [r for r in rows if r[0] == ctx and r[2] == kv and r[5]]
            best = min(ok, key=lambda r: float(r[5]))
            dflt = next(r for r in ok if r[3] == "default")
            print(f"ctx {ctx} {kv}: default {dflt[5]} us {dflt[6]} GB/s {dflt[4]}; best {best[5]} us {best[6]} GB/s {best[4]}",
                  flush=True)
    write_csv(path, ["ctx", "cache", "kv", "trial", "config", "us", "kv_GBps", "error"], rows)


def warps(path: str):
    """The split kernel with one warp a program (no cross-warp softmax reductions) against 2 and 4, and the default, at
    256 / 2113 / 8256 slots, bf16 cache, with the prepared merge (one warp lost everywhere in session 41 and left the
    tune space: bench/results/2026-12-07_h100_attention_warps_s41.csv)."""
    rows = []
    for ctx, S in ((130, 256), (2050, 2113), (8193, 8256)):
        q, k, v, pos = inputs(ctx, S)
        default = AS.attention_split_kernel.default_config(q, k, v, pos, **KW)
        keys = (default["KEYS_PER_SPLIT"] // 2, default["KEYS_PER_SPLIT"], default["KEYS_PER_SPLIT"] * 2)
        trials = [("default", None)] + [("sweep", {**default, "KEYS_PER_SPLIT": ks, "BLOCK_N": min(default["BLOCK_N"], ks),
                                                   "num_warps": w}) for w, ks in itertools.product((1, 2, 4), keys)]
        for name, cfg in trials:
            us, error = timed(lambda: split(q, k, v, pos, KW, cfg))
            rows.append([ctx, S, name, cfg or default, us, error])
            print(*rows[-1][:5], flush=True)
    write_csv(path, ["ctx", "cache", "trial", "config", "us", "error"], rows)


def merges(path: str):
    """The split alone, the prepared merge alone over its warps, and the two together as the route runs them, at
    256 / 2113 / 8256 slots (bf16 cache, default split): whether the merge's time grows with the ranges because 32
    programs walk them. (Session 41 ran it with a GROUPS tunable, since removed: a program a group or two.)"""
    rows = []
    for ctx, S in ((130, 256), (2050, 2113), (8193, 8256)):
        q, k, v, pos = inputs(ctx, S)
        default = AS.attention_split_kernel.default_config(q, k, v, pos, **KW)
        parts = AS.attention_split_kernel(q, k, v, pos, **KW)
        rows.append([ctx, S, "split", default, *timed(lambda: AS.attention_split_kernel(q, k, v, pos, **KW))])
        for w in (1, 2, 4):
            cfg = {"num_warps": w}
            rows.append([ctx, S, "merge_prep", cfg, *timed(
                lambda: AS.attention_merge_prep(*parts, q, PER=PREP[0], GROUP=PREP[1], config=cfg))])
        rows.append([ctx, S, "split+merge (route)", "default", *timed(lambda: split(q, k, v, pos, KW, None))])
        for r in rows[-5:]:
            print(*r[:5], flush=True)
    write_csv(path, ["ctx", "cache", "kernel", "config", "us", "error"], rows)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "attention_decode.csv"
    mode = sys.argv[2:]
    {"kv": kv_dtypes, "long": long_contexts, "warps": warps, "merge": merges}.get(mode[0] if mode else "", main)(out)
