"""Quantized GEMM benchmarks (`bench_kernels.py --suite quant`): kilnx against cuBLAS bf16 on the
dequantized weight and the HBM copy ceiling, in the same process.

qmv cases time the whole path a model call takes (prep of x + the GEMV); the GEMV alone is reported
too, so the prep's share is visible. For M > 1 the swapped-operand qmm (weight on the MMA's wide
side) competes with qmv, and the faster one is the case's value (its config names which).
"""

from __future__ import annotations

import os
import traceback

import torch

from bench_kernels import copies_for, time_calls
from kilnx.kernels import qmatmul, qmv_h2, qmv_tc, routing
from kilnx.quant import QWeight

LLAMA8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# (BLOCK_N, BLOCK_KW, SPLIT_K, num_warps) x STAGES: STAGES > 1 pipelines the chunk loop's loads
QMV_CONFIGS = [dict(BLOCK_N=bn, BLOCK_KW=kw, SPLIT_K=sk, num_warps=nw, STAGES=st, MAGIC=mg)
               for bn, kw, sk, nw, st, mg in [
                   (4, 256, 1, 4, 1, False), (4, 128, 1, 4, 1, True), (8, 128, 1, 4, 1, True),
                   (2, 256, 1, 2, 1, True), (8, 256, 1, 8, 1, True), (4, 512, 1, 4, 1, True),
                   (16, 64, 1, 4, 3, True), (4, 128, 2, 4, 3, True), (8, 128, 1, 4, 2, True),
                   (8, 64, 1, 4, 4, True), (16, 128, 1, 8, 3, True), (32, 64, 1, 8, 3, True)]]
WIDE_CONFIGS = [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns, MAGIC=True, SWAP=True)
                for bn, bk, nw, ns in [(64, 128, 4, 3), (128, 128, 4, 3), (64, 256, 4, 3), (128, 256, 8, 3),
                                       (128, 64, 4, 4), (256, 128, 8, 3), (32, 256, 4, 4)]]
# qmv_tc: (BLOCK_N, SPLIT_K, num_warps, STAGES, SWAP)
TC_CONFIGS = [dict(BLOCK_N=bn, SPLIT_K=sk, num_warps=nw, STAGES=st, SWAP=sw)
              for bn, sk, nw, st, sw in [
                  (64, 1, 4, 3, True), (128, 1, 4, 4, True), (64, 1, 4, 6, True), (128, 1, 8, 4, True),
                  (256, 1, 8, 3, True), (64, 2, 4, 4, True), (128, 2, 4, 4, True), (32, 1, 2, 4, False),
                  (64, 1, 4, 4, False), (16, 2, 1, 4, False), (64, 4, 4, 4, True), (32, 2, 2, 6, False)]]
QMM_CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns, MAGIC=mg, SWAP=sw)
               for bm, bn, bk, nw, ns, mg, sw in [
                   (128, 128, 64, 8, 3, False, False), (128, 256, 64, 8, 3, True, False),
                   (64, 128, 64, 4, 4, True, False), (128, 128, 128, 8, 3, True, False),
                   (128, 64, 64, 4, 4, True, False), (128, 128, 64, 8, 4, True, True),
                   (64, 256, 64, 8, 3, True, True), (128, 256, 64, 8, 3, True, True),
                   (128, 128, 32, 4, 4, True, False), (64, 128, 128, 4, 3, True, False),
                   (256, 128, 64, 8, 3, True, False), (256, 128, 32, 8, 4, True, False)]] + [
    # 4-bit codes decoded two per bf16x2 instruction (kernels/bf16_decode.py): 191 SASS instructions per
    # K step at 128 x 128 x 64, 8 warps, against 312 for the fp32 decode (offline count, session 14)
    # (session 15, M=512: 128 x 128 x 64 / 8 warps 361 us against 447 for the fp32 decode's best). With SWAP
    # the decoded weight is the MMA's A operand, which Hopper's wgmma can take from registers
    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns, MAGIC=True, SWAP=sw, PACKED=True)
    # (128 x 256 x 64 / 8 warps and 64 x 128 x 64 / 4 warps without SWAP do not compile: Triton 3.6 reports an
    # illegal shared layout)
    for bm, bn, bk, nw, ns, sw in [(128, 128, 64, 8, 3, False), (256, 128, 64, 8, 3, False),
                                   (128, 128, 64, 8, 4, False), (128, 64, 64, 4, 4, False),
                                   (32, 64, 128, 4, 3, True), (64, 64, 128, 4, 3, True), (64, 128, 64, 4, 3, True),
                                   (128, 128, 64, 8, 3, True), (128, 128, 64, 8, 4, True), (128, 64, 64, 4, 3, True),
                                   (128, 128, 64, 4, 3, True), (256, 128, 64, 8, 3, True), (64, 256, 64, 8, 3, True)]]
# qmm's default above 64 rows on the GPU until session 15 (the fp32 decode)
FP32_DECODE_DEFAULT = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, MAGIC=False, SWAP=False, num_warps=4, num_stages=2)
H2_TILES = [(16, 128, 1, 2), (32, 128, 1, 4), (16, 64, 1, 1), (8, 256, 1, 4), (4, 512, 1, 4), (8, 128, 1, 2),
            (16, 256, 1, 4), (32, 64, 1, 2), (8, 64, 1, 1), (4, 256, 2, 2)]
if os.environ.get("H2_TILES"):   # e.g. "8x128x1x2,16x128x1x2": BLOCK_N x BLOCK_KW x SPLIT_K x num_warps
    H2_TILES = [tuple(int(v) for v in t.split("x")) for t in os.environ["H2_TILES"].split(",")]
# $H2_CHAIN ("1,2,4"): words per fp16 accumulator (qmv_h2's CHAIN)
H2_CONFIGS = [dict(BLOCK_N=bn, BLOCK_KW=kw, SPLIT_K=sk, num_warps=nw, STAGES=st, **({"CHAIN": ch} if ch else {}))
              for st in [int(v) for v in os.environ.get("H2_STAGES", "1,2,3").split(",")]
              for ch in [int(v) for v in os.environ.get("H2_CHAIN", "0").split(",")]
              for bn, kw, sk, nw in H2_TILES]
# qmv_tc: (BLOCK_N, SPLIT_K, num_warps, STAGES, SWAP)
TC_CONFIGS = [dict(BLOCK_N=bn, SPLIT_K=sk, num_warps=nw, STAGES=st, SWAP=sw)
              for bn, sk, nw, st, sw in [
                  (64, 1, 4, 3, True), (128, 1, 4, 4, True), (64, 1, 4, 6, True), (128, 1, 8, 4, True),
                  (256, 1, 8, 3, True), (64, 2, 4, 4, True), (128, 2, 4, 4, True), (32, 1, 2, 4, False),
                  (64, 1, 4, 4, False), (16, 2, 1, 4, False), (64, 4, 4, 4, True), (32, 2, 2, 6, False)]]
# TMA boxes only (pointer tiles were never faster, session 11); each tile as a 2-d grid and as a persistent
# kernel (one program per SM, tile and K loops pipelined as one)
MM_CONFIGS = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns, TMA=True, PERSISTENT=pers)
              for pers in (False, True)
              for bm, bn, bk, nw, ns in [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                                         (256, 128, 64, 8, 3), (64, 256, 64, 4, 4), (128, 256, 64, 8, 4),
                                         (128, 128, 128, 8, 3)]]


# qmm_wg at the GEMV's sizes (16 rows a program): groups a K step x split over K x stages (4 groups a step,
# the probe's best, first: $QMV_CONFIGS_MAX keeps the first few)
WG_CONFIGS = [dict(BLOCK_M=16, GPI=g, SPLIT_K=sk, num_stages=st) for g in (4, 8, 2) for sk in (2, 4, 8, 1)
              for st in (3, 1)]


def _wg_path(sets, bits, dev, extra):
    """("qmm_wg", call, configs) over the same inputs, the operand layout packed once per weight copy
    outside the timing; None where it does not serve (not 4-bit, or no GPU outside the interpreter)."""
    from kilnx.codegen.launch import interpreting
    from kilnx.kernels import qmv_wg as W
    if bits != 4 or not (dev == "cuda" or interpreting()):
        return None
    ops = {id(wq): (W.flat(W.pack_operand(wq)), W.group_major(s), W.group_major(b)) for _, wq, s, b in sets}
    x0, wq0 = sets[0][:2]
    default = W.qmm_wg.default_config(x0, *ops[id(wq0)])
    return "qmm_wg", lambda x, wq, s, b, config: W.qmm_wg(x, *ops[id(wq)], config=config), \
        [default] + WG_CONFIGS[:extra]


def _wg_direct_path(sets, bits, dev, extra):
    """("qmm_wg_direct", call, configs): the same kernel reading MLX's layout (kernels/wg_direct.py); None
    where it does not serve."""
    from kilnx.codegen.launch import interpreting
    from kilnx.kernels import wg_direct as D
    x0, wq0, s0, b0 = sets[0]
    if bits != 4 or not (dev == "cuda" or interpreting()) or not D.takes(x0, wq0, s0, b0):
        return None
    as_bytes = D.as_bytes
    # each split both ways (INTERLEAVE: a tile's programs take its K steps in turn), side by side in the list
    configs = [dict(BLOCK_M=16, GPI=g, SPLIT_K=sk, num_stages=st, **({"INTERLEAVE": True} if il else {}))
               for g in (4, 8) for st in (1, 3) for sk in (4, 2, 8, 1) for il in (False, True) if sk > 1 or not il]
    done = D.counters_for(x0, wq0.shape[0])
    default = D.qmm_wg_direct.default_config(x0, as_bytes(wq0), s0, b0, done)
    return "qmm_wg_direct", \
        lambda x, wq, s, b, config: D.qmm_wg_direct(x, as_bytes(wq), s, b, done, config=config), \
        [default] + configs[:extra]


def _wg_direct_xperm_path(sets, default_and_configs):
    """("qmm_wg_direct_xperm", call, configs): the same kernel on x already in its K order (X_PERMUTED: what a
    producer writing that order would hand it), permuted outside the timed call."""
    from kilnx.kernels import wg_direct as D
    perms = {id(x): D.permute_k(x) for x, *_ in sets}
    done = D.counters_for(sets[0][0], sets[0][1].shape[0])
    return "qmm_wg_direct_xperm", \
        lambda x, wq, s, b, config: D.qmm_wg_direct(perms[id(x)], D.as_bytes(wq), s, b, done, X_PERMUTED=True,
                                                    config=config), \
        default_and_configs


def bench_quant(rec, copy_bw: float, smoke: bool):
    """$KILNX_BENCH_ONLY=qmm limits the run to the qmm cases; $QMV_SHAPES (e.g. "gate_up,o"), $QMV_MS
    ("1,4") and $QMV_PATHS ("qmv_h2") narrow the qmv cases (default: all)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = LLAMA8B if not smoke else {"o": (64, 256)}
    if os.environ.get("QMV_SHAPES") and not smoke:
        shapes = {k: shapes[k] for k in os.environ["QMV_SHAPES"].split(",")}
    only = os.environ.get("KILNX_BENCH_ONLY", "")
    only_qmm = only == "qmm"
    if only in ("gate_up", "fp4"):   # the headline shape only: M = 1 and 4, every format (or fp4 alone)
        shapes = {k: v for k, v in shapes.items() if k in ("gate_up", "o")}
        shapes = {k: v for k, v in list(shapes.items())[-1:]}
    if only == "fp4":
        [(label, (n, k))] = shapes.items()
        for mode in ("mxfp4", "nvfp4"):
            _safe(rec, f"qmv_{mode}_M1_{label}", lambda mode=mode: _bench_fp4(rec, label, n, k, mode, dev, copy_bw, smoke))
        return
    for label, (n, k) in ({} if only_qmm else shapes).items():
        ms = (1, 4) if only == "gate_up" else (1, 4, 8) if not smoke else (1, 3)
        if os.environ.get("QMV_MS") and not smoke:
            ms = tuple(int(v) for v in os.environ["QMV_MS"].split(","))
        for m in ms:
            _safe(rec, f"qmv_b4_M{m}_{label}", lambda: _bench_qmv(rec, label, n, k, m, 4, dev, copy_bw, smoke))
    label = "gate_up" if not smoke else "o"
    n, k = shapes[label]
    narrowed_past_m1 = bool(os.environ.get("QMV_MS")) and "1" not in os.environ["QMV_MS"].split(",") and not smoke
    if not only_qmm and not narrowed_past_m1:      # the 8-bit and fp4 cases are M = 1 ones
        _safe(rec, f"qmv_b8_M1_{label}", lambda: _bench_qmv(rec, label, n, k, 1, 8, dev, copy_bw, smoke))
        for mode in ("mxfp4", "nvfp4"):
            _safe(rec, f"qmv_{mode}_M1_{label}", lambda mode=mode: _bench_fp4(rec, label, n, k, mode, dev, copy_bw, smoke))
    qmm_ms = (512, 4096) if not smoke and only not in ("qmv", "gate_up") else (32,) if smoke else ()
    if os.environ.get("QMM_MS") and not smoke:   # e.g. "64,128,256,512": where the route's crossover lies
        qmm_ms = tuple(int(v) for v in os.environ["QMM_MS"].split(","))
    # $QMM_SHAPES (e.g. "o,qkv,down"): the qmm cases on other llama-3.1-8b projections (default gate_up)
    qmm_shapes = os.environ["QMM_SHAPES"].split(",") if os.environ.get("QMM_SHAPES") and not smoke else [label]
    for label in qmm_shapes:
        n, k = LLAMA8B[label] if not smoke else shapes[label]
        for m in qmm_ms:
            _safe(rec, f"qmm_b4_M{m}_{label}", lambda: _bench_qmm(rec, label, n, k, m, dev, smoke))


def _safe(rec, case, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - one broken case must not end the run
        rec.add("quant", case, "error", repr(e)[:200])
        traceback.print_exc()


def _qargs(m, n, k, bits, dev, copies):
    p = {"M": m, "N": n, "K": k, "bits": bits, "gs": 64}
    return [qmatmul.make_qmatmul_args(p, dev) for _ in range(copies)]


def _measure(case, run, sets, ref, reps=20, tol=2e-2):
    """Seconds per call, or None when the output is wrong or the config does not compile."""
    try:
        got = run(*sets[0]).float()
        err = (got - ref).abs().max().item() / (ref.abs().max().item() + 1e-9)
        if not err < tol:
            print(f"{case}: wrong (rel err {err:.3g}), skipped")
            return None
        return time_calls(run, sets, reps=reps)
    except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
        print(f"{case}: {e!r}"[:300])
        return None


def _bench_qmv(rec, label, n, k, m, bits, dev, copy_bw, smoke):
    wbytes = n * k * bits // 8 + 2 * 2 * n * (k // 64)
    sets = _qargs(m, n, k, bits, dev, copies_for(wbytes, smoke))
    case = f"qmv_b{bits}_M{m}_{label}"
    ref = qmatmul._dense_peer(*sets[0]).float()
    problem = {"M": m, "N": n, "K": k, "bits": bits, "gs": 64}
    # (path, call, its configs: the runtime's default first); each path's results are timed on the same inputs
    wanted = os.environ.get("QMV_PATHS", "qmv,qmv_h2,qmv_tc,qmm,qmm_wg,qmm_wg_direct,qmm_wg_direct_xperm").split(",")
    extra = int(os.environ.get("QMV_CONFIGS_MAX", "1000")) if not smoke else 2   # configs per path past its default
    paths = []
    if "qmv" in wanted or bits not in qmv_h2.BITS_SERVED:
        default = qmatmul.qmv.default_config(*qmatmul.make_qmv_args(problem, dev))
        paths.append(("qmv", qmatmul.run_qmv, [default] + QMV_CONFIGS[: (3 if smoke else None)]))
    if bits in qmv_h2.BITS_SERVED and "qmv_h2" in wanted:
        default = qmv_h2.qmv_h2.default_config(*qmv_h2.make_qmv_h2_args(problem, dev))
        paths.append(("qmv_h2", qmv_h2.run_qmv_h2, [default] + H2_CONFIGS[:int(os.environ.get("QMV_H2_MAX", extra))]))
    if "qmv_tc" in wanted and dev == "cuda":
        default = qmv_tc.qmv_tc.default_config(*sets[0])
        paths.append(("qmv_tc", qmv_tc.run_qmv_tc, [default] + TC_CONFIGS[:extra]))
    if (m > 1 or not smoke) and "qmm" in wanted:
        paths.append(("qmm", qmatmul.qmm, WIDE_CONFIGS[: (2 if smoke else None)]))
    if "qmm_wg" in wanted and m <= 16 and (wg := _wg_path(sets, bits, dev, extra)) is not None:
        paths.append(wg)
    if {"qmm_wg_direct", "qmm_wg_direct_xperm"} & set(wanted) and m <= 64 and \
            (wgd := _wg_direct_path(sets, bits, dev, extra)) is not None:
        if "qmm_wg_direct" in wanted:
            paths.append(wgd)
        if "qmm_wg_direct_xperm" in wanted:
            paths.append(_wg_direct_xperm_path(sets, wgd[2]))
    results = []   # (seconds, path, config)
    for path, call, configs in paths:
        for cfg in configs:
            run = lambda x, wq, s, b, call=call, cfg=cfg: call(x, wq, s, b, config=cfg).to(x.dtype)  # noqa: E731
            t = _measure(f"{case} {path} {cfg}", run, sets, ref)
            if t is not None:
                results.append((t, path, cfg))
                if os.environ.get("QMV_SWEEP_ROWS"):   # every config's time, for choosing defaults
                    rec.add("quant_sweep", case, "us", t * 1e6, "config", f"{path} {cfg}")

    def gemv_alone(path, kernel, make_args):
        """(best path result, the GEMV alone on prepared inputs with that config, seconds)"""
        best = min((r for r in results if r[1] == path), key=lambda r: r[0])
        prepared = [make_args(problem, dev) for _ in range(len(sets))]
        return best, time_calls(lambda *a: kernel(*a, config=best[2]), prepared)

    if any(r[1] == "qmv" for r in results):
        qmv_best, t_gemv = gemv_alone("qmv", qmatmul.qmv, qmatmul.make_qmv_args)
        rec.add("quant", case, "us_gemv_only", t_gemv * 1e6, "us_qmv_path_best", qmv_best[0] * 1e6)
    dense = [(x, qmatmul._dense_spec_weight(x, wq, s, b)) for x, wq, s, b in sets[:max(2, copies_for(n * k * 2, smoke))]]
    t_cublas = time_calls(lambda x, w: x @ w.T, dense)
    t_default = results[0][0]
    best = min(results, key=lambda r: r[0])
    rec.add("quant", case, "GBps", wbytes / best[0] / 1e9, "cublas_bf16_GBps", n * k * 2 / t_cublas / 1e9)
    rec.add("quant", case, "GBps_default_config", wbytes / t_default / 1e9, "copy_GBps", copy_bw)
    rec.add("quant", case, "pct_of_copy", 100 * wbytes / best[0] / 1e9 / copy_bw, "best_config",
            f"{best[1]} {best[2]}")
    rec.add("quant", case, "us", best[0] * 1e6, "cublas_bf16_us", t_cublas * 1e6)
    h2 = [r for r in results if r[1] == "qmv_h2"]
    if h2:
        h2_best, t_h2 = gemv_alone("qmv_h2", qmv_h2.qmv_h2, qmv_h2.make_qmv_h2_args)
        rec.add("quant", case, "us_qmv_h2_path_best", h2_best[0] * 1e6, "config", str(h2_best[2]))
        rec.add("quant", case, "us_gemv_h2_only", t_h2 * 1e6, "us_qmv_h2_path_default", h2[0][0] * 1e6)
    tc = [r for r in results if r[1] == "qmv_tc"]
    if tc:
        tc_best = min(tc, key=lambda r: r[0])
        rec.add("quant", case, "us_qmv_tc_best", tc_best[0] * 1e6, "config", str(tc_best[2]))
        rec.add("quant", case, "us_qmv_tc_default", tc[0][0] * 1e6)
    wide = [r for r in results if r[1] == "qmm"]
    if wide:
        rec.add("quant", case, "us_qmm_swap_best", min(wide, key=lambda r: r[0])[0] * 1e6)
    for name in ("qmm_wg", "qmm_wg_direct", "qmm_wg_direct_xperm"):
        wg = [r for r in results if r[1] == name]
        if wg:
            wg_best = min(wg, key=lambda r: r[0])
            rec.add("quant", case, f"us_{name}_best", wg_best[0] * 1e6, "config", str(wg_best[2]))
            rec.add("quant", case, f"us_{name}_default", wg[0][0] * 1e6)


def _bench_fp4(rec, label, n, k, mode, dev, copy_bw, smoke):
    """fp4 GEMV at M=1 (mxfp4: e8m0 scales per 32, nvfp4: e4m3 per 16), against the copy ceiling."""
    from kilnx.kernels import qmatmul_fp4 as F
    group = 32 if mode == "mxfp4" else 16
    wbytes = n * k // 2 + n * (k // group)
    p = {"M": 1, "N": n, "K": k, "mode": mode}
    sets = [F.make_fp4_args(p, dev) for _ in range(copies_for(wbytes, smoke))]
    x0, wq0, s0, g0 = sets[0]
    ref = x0.float() @ F.dense_weight(wq0, s0, g0).float().to(x0.device).T
    from kilnx.kernels import fp4_qmv_h2 as F2
    results = []
    paths = [("fp4_qmv", F.run_fp4_qmv, F.fp4_qmv, QMV_CONFIGS), ("fp4_qmv_h2", F2.run_fp4_qmv_h2, F2.fp4_qmv_h2, H2_CONFIGS)]
    for path, call, kernel, configs in paths:
        for cfg in [kernel.default_config(*kernel.make_args(p, dev))] + configs[: (2 if smoke else None)]:
            cfg = {key: v for key, v in cfg.items() if key in kernel.space.params}
            run = lambda x, wq, s, g, cfg=cfg, call=call: call(x, wq, s, g, config=cfg)  # noqa: E731
            t = _measure(f"qmv_{mode} {path} {cfg}", run, sets, ref)
            if t is not None:
                results.append((t, {"path": path, **cfg}))
                if os.environ.get("QMV_SWEEP_ROWS"):   # every config's time, for choosing defaults
                    rec.add("quant_sweep", f"qmv_{mode}_M1_{label}", "us", t * 1e6, "config", f"{path} {cfg}")
    best = min(results, key=lambda r: r[0])
    case = f"qmv_{mode}_M1_{label}"
    for path in ("fp4_qmv", "fp4_qmv_h2"):
        mine = [r for r in results if r[1]["path"] == path]
        if mine:
            t, cfg = min(mine, key=lambda r: r[0])
            rec.add("quant", case, f"pct_of_copy_{path}", 100 * wbytes / t / 1e9 / copy_bw, "config", str(cfg))
    rec.add("quant", case, "GBps", wbytes / best[0] / 1e9, "copy_GBps", copy_bw)
    rec.add("quant", case, "pct_of_copy", 100 * wbytes / best[0] / 1e9 / copy_bw, "best_config", str(best[1]))


def _bench_qmm(rec, label, n, k, m, dev, smoke):
    sets = _qargs(m, n, k, 4, dev, 2)
    case = f"qmm_b4_M{m}_{label}"
    ref = qmatmul._dense_peer(*sets[0]).float()
    results = []
    # $QMM_FUSED_SWEEP=0: the fused kernel on its default config only (its sweep is in sessions 2-11)
    # (with the fp32 decode's default before session 15 always: the packed default's gain in the same run)
    fused = [FP32_DECODE_DEFAULT] + QMM_CONFIGS[: (2 if smoke else 0 if os.environ.get("QMM_FUSED_SWEEP") == "0"
                                                   else None)]
    for cfg in [qmatmul.qmm.default_config(*sets[0])] + fused:
        run = lambda x, wq, s, b, cfg=cfg: qmatmul.qmm(x, wq, s, b, config=cfg)  # noqa: E731
        t = _measure(f"{case} {cfg}", run, sets, ref, reps=10, tol=3e-2)
        if t is not None:
            results.append((t, cfg))
            rec.add("quant_sweep", case, "us_fused_qmm", t * 1e6, "config", str(cfg))
    # the two-kernel path: dequantize the weight once, then the dense DSL GEMM
    mm_only = []
    dense = [(x, qmatmul._dense_spec_weight(x, wq, s, b)) for x, wq, s, b in sets]
    # $QMM_MM_SWEEP=0: only the route's default config of the two-kernel path
    for cfg in MM_CONFIGS[: (1 if smoke or os.environ.get("QMM_MM_SWEEP") == "0" else None)]:
        run = lambda x, wq, s, b, cfg=cfg: qmatmul.dequant_mm(x, wq, s, b, config=cfg)  # noqa: E731
        t = _measure(f"{case} dequant+mm {cfg}", run, sets, ref, reps=10, tol=3e-2)
        if t is not None:
            results.append((t, {"path": "dequant+mm", **cfg}))
            mm_only.append((time_calls(lambda x, w, cfg=cfg: qmatmul.mm(x, w, config=cfg), dense, reps=10), cfg))
            rec.add("quant_sweep", case, "us_mm", mm_only[-1][0] * 1e6, "config", str(cfg))
    # the two-kernel path on its default, timed at every M (where it overtakes the fused kernel is the
    # route's crossover, routing.takes_dequant_mm)
    t_two = _measure(f"{case} dequant+mm default", lambda x, wq, s, b: qmatmul.dequant_mm(x, wq, s, b), sets, ref,
                     reps=10, tol=3e-2)
    if t_two is not None:
        rec.add("quant_sweep", case, "us_dequant_mm_default", t_two * 1e6)
    # what the public op runs at these rows (its route and defaults)
    ws = {id(wq): QWeight.from_mlx(wq, s, b, bits=4, group_size=64) for _, wq, s, b in sets}
    t_route = _measure(f"{case} qmatmul", lambda x, wq, s, b: qmatmul.qmatmul(x, ws[id(wq)]), sets, ref,
                       reps=10, tol=3e-2)
    t_cublas = time_calls(lambda x, w: x @ w.T, dense, reps=10)
    best = min(results, key=lambda r: r[0])
    flops = 2 * m * n * k
    if mm_only:
        t_mm, cfg_mm = min(mm_only, key=lambda r: r[0])
        rec.add("quant", case, "ratio_dense_mm_vs_cublas_time", t_mm / t_cublas, "best_config", str(cfg_mm))
        for pers in (False, True):   # one program per tile against one per SM, same run
            side = [r for r in mm_only if r[1]["PERSISTENT"] is pers]
            if side:
                t_side, cfg_side = min(side, key=lambda r: r[0])
                rec.add("quant", case, f"ratio_dense_mm_persistent_{'on' if pers else 'off'}_vs_cublas_time",
                        t_side / t_cublas, "best_config", str(cfg_side))
    rec.add("quant", case, "ratio_vs_cublas_time", best[0] / t_cublas, "best_config", str(best[1]))
    if t_route is not None:
        rec.add("quant", case, "ratio_vs_cublas_time_default", t_route / t_cublas, "path",
                "dequant+mm" if routing.takes_dequant_mm(*sets[0]) else "qmm")
    rec.add("quant", case, "ratio_fused_qmm_default_vs_cublas_time", results[0][0] / t_cublas)
    rec.add("quant", case, "TFLOPs", flops / best[0] / 1e12, "cublas_bf16_TFLOPs", flops / t_cublas / 1e12)
