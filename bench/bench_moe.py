"""MoE benchmarks (`bench_kernels.py --suite moe`): one qwen3-30b-a3b MoE layer (128 experts, top-8,
hidden 2048, expert width 768, 4-bit gs64 weights, bf16 activations), kilnx against cuBLAS bf16 and
the HBM copy ceiling in the same process.

- moe_prefill2048_qwen3_30b_a3b (tok_s): 2048 tokens through align + gate_up with SwiGLU + down with
  the routing-weighted sum over top-8 (three launches and a cast). The bar is 10x MLX's 272 tok/s per
  model, per layer: 272 x 48 layers x 10 = 130,560 tok/s. Block heights (the align's BLOCK_M) and
  GEMM configs are swept; `tok_s` is the best, `tok_s_default_config` is kilnx.ops.moe untuned.
  Peer: cuBLAS bf16 doing the same FLOPs as two dense GEMMs (slots x hidden @ hidden x 2F and
  slots x F @ F x hidden), i.e. a grouped GEMM with no routing, padding or dequantization cost.
- moe_decode{1,4}_qwen3_30b_a3b (GBps, pct_of_copy): the decode path kilnx.ops.moe takes on the GPU
  (kernels/moe_h2.py: prep x, gate_up + SwiGLU, prep h, down + weighted sum; its GEMVs swept), GB/s
  over the bytes of the experts the step touches (packed words + scales + biases); `*_f32_gemvs`: the
  two fp32 per-slot GEMVs of kernels/moe.py on the same inputs. Each input copy routes to other
  experts of one weight stack, so successive replays do not find the weights in L2. Peer: cuBLAS
  bf16 on the same experts' weights laid out dense (one GEMV each for gate_up and down).
"""

from __future__ import annotations

import os
import traceback

import torch

from bench_kernels import copies_for, time_calls
from kilnx.kernels import moe as M
from kilnx.kernels.moe_align import align, align_block_m
from kilnx.kernels.moe_specs import gemm_seeds, gemv_seeds, random_expert_weights, routed_experts
from kilnx.quant import QWeight

QWEN3_30B_A3B = dict(E=128, top_k=8, hidden=2048, width=768)
MLX_TOK_S_PER_MODEL, QWEN3_30B_A3B_LAYERS = 272, 48
PREFILL_BAR_TOK_S = 10 * MLX_TOK_S_PER_MODEL * QWEN3_30B_A3B_LAYERS
BITS, GS = 4, 64

# swept: each kernel's default config for the shape, then the first of the tuner's seeds for it
# (about 40 Triton compiles in all: the suite fits the GPU driver's 200 s step)
# and the first seeds with 4-bit codes decoded two per bf16x2 instruction (kernels/bf16_decode.py; the GLU
# GEMM's K loop 292 sm_90 SASS instructions against 546, offline count, session 14)
GEMM_CONFIGS = gemm_seeds()[:4] + [{"MAGIC": False}] + [{**c, "PACKED": True} for c in gemm_seeds()]
GLU_CONFIGS = gemv_seeds("glu")[:5]
COMBINE_CONFIGS = gemv_seeds("combine")[:5]


def bench_moe(rec, copy_bw: float, smoke: bool):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shape = QWEN3_30B_A3B if not smoke else dict(E=8, top_k=2, hidden=128, width=64)
    E, H, F = shape["E"], shape["hidden"], shape["width"]
    gu, dn = _stack(E, 2 * F, H, dev), _stack(E, H, F, dev)
    dense = _dense_bf16(gu), _dense_bf16(dn)
    # $KILNX_MOE_PREFILL_TOKENS (e.g. "2048,256"): prefill sizes (at 256 tokens the blocks are 16 rows)
    tokens = [int(t) for t in os.environ.get("KILNX_MOE_PREFILL_TOKENS", "2048").split(",")] if not smoke else [32]
    for T in tokens if os.environ.get("KILNX_MOE_CASES", "all") != "decode" else ():   # decode only: =decode
        _safe(rec, f"moe_prefill{T}_qwen3_30b_a3b", lambda: _bench_prefill(rec, T, shape, gu, dn, dense, dev, smoke))
    # decode: the configs swept at one token; at four, the default against those winners
    configs = [GLU_CONFIGS[: (1 if smoke else None)], COMBINE_CONFIGS[: (1 if smoke else None)]]
    for T in ((1, 4) if not smoke else (1,)):
        case = f"moe_decode{T}_qwen3_30b_a3b"
        best = _safe(rec, case, lambda: _bench_decode(rec, case, T, shape, gu, dn, dense, configs, dev, copy_bw, smoke))
        if best is not None:
            configs = [[best[0]], [best[1]]]


def _safe(rec, case, fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one broken case must not end the run
        rec.add("moe", case, "error", repr(e)[:200])
        traceback.print_exc()
        return None


def _stack(E, n, k, dev) -> QWeight:
    torch.manual_seed(n + k)
    wq, s, b = (t.to(dev) for t in random_expert_weights(E, n, k, BITS, GS))
    return QWeight.from_mlx(wq, s, b, bits=BITS, group_size=GS)


def _dense_bf16(w: QWeight) -> torch.Tensor:
    """The stack dequantized to bf16 on its device, one expert at a time (for references and peers)."""
    E, N, KW = w.packed.shape
    shifts = torch.arange(0, 32, BITS, device=w.packed.device, dtype=torch.int32)
    out = torch.empty(E, N, KW * 32 // BITS, dtype=torch.bfloat16, device=w.packed.device)
    for e in range(E):
        codes = ((w.packed[e][..., None] >> shifts) & ((1 << BITS) - 1)).reshape(N, -1).float()
        s, b = (t[e].float().repeat_interleave(GS, 1) for t in (w.scales, w.biases))
        out[e] = (codes * s + b).bfloat16()
    return out


def _reference(x, gu_dense, dn_dense, ids, rw):
    """bf16 cuBLAS per expert, fp32 sums: (h (slots, F), y (T, H)) to check kilnx's outputs against."""
    T, k = ids.shape
    flat, token = ids.reshape(-1), torch.arange(T * k, device=x.device) // k
    h = torch.zeros(T * k, dn_dense.shape[2], dtype=torch.bfloat16, device=x.device)
    y = torch.zeros(T, dn_dense.shape[1], dtype=torch.float32, device=x.device)
    for e in flat.unique().tolist():
        sel = (flat == e).nonzero().flatten()
        gate, up = (x[token[sel]] @ gu_dense[e].T).float().chunk(2, dim=-1)
        h[sel] = (torch.nn.functional.silu(gate) * up).bfloat16()
        y.index_add_(0, token[sel], (h[sel] @ dn_dense[e].T).float() * rw.reshape(-1)[sel, None].float())
    return h, y.bfloat16()


def _rel_err(got, want) -> float:
    return (got.float() - want.float()).abs().max().item() / (want.float().abs().max().item() + 1e-9)


def _best(case, kernel, args_of, configs, sets, check, reps=10):
    """(seconds, config) of the fastest of `kernel`'s default config and `configs` (each run on
    args_of(*set)) whose output passes `check`; wrong or failing configs are skipped."""
    default = kernel.default_config(*args_of(*sets[0]))
    results = []
    for cfg in [default] + [c for c in configs if kernel.space.validate(c) != default]:
        def run(*a, cfg=cfg):
            return kernel(*args_of(*a), config=cfg)
        try:
            err = check(run(*sets[0]))
            if not err < 3e-2:
                print(f"{case} {cfg}: wrong (rel err {err:.3g}), skipped")
                continue
            results.append((time_calls(run, sets, reps=reps), kernel.space.validate(cfg)))
            print(f"{case} {results[-1][1]}: {results[-1][0] * 1e6:.2f} us")
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
            print(f"{case} {cfg}: {e!r}"[:300])
    return min(results, key=lambda r: r[0])


def _bench_prefill(rec, T, shape, gu, dn, dense, dev, smoke):
    case = f"moe_prefill{T}_qwen3_30b_a3b"
    E, k, H, F = shape["E"], shape["top_k"], shape["hidden"], shape["width"]
    torch.manual_seed(1)
    ids = routed_experts(T, k, E).to(dev)
    rw = torch.softmax(torch.randn(T, k), dim=-1).bfloat16().to(dev)
    sets = [(torch.randn(T, H).bfloat16().to(dev),) for _ in range(2)]   # the weights (300 MB) exceed L2
    g, d = (gu.packed, gu.scales, gu.biases), (dn.packed, dn.scales, dn.biases)
    h_ref, y_ref = _reference(sets[0][0], *dense, ids, rw)

    t_default = time_calls(lambda x: M.moe(x, gu, dn, ids, rw), sets, reps=10)
    assert _rel_err(M.moe(sets[0][0], gu, dn, ids, rw), y_ref) < 3e-2, "kilnx.ops.moe is wrong"
    best = None
    bm0 = align_block_m(T * k, E)   # the runtime's block height at this size, and twice it
    for bm in ((bm0, 2 * bm0) if not smoke else (16,)):
        sorted_ids, block_expert, _ = align(ids, E, bm)
        t_align = time_calls(lambda i: align(i, E, bm), [(ids,)] * 2, reps=10)
        t_gu, cfg_gu = _best(f"{case} BM={bm} gate_up", M.gather_qmm_glu,
                             lambda x: (x, *g, sorted_ids, block_expert, ids),
                             GEMM_CONFIGS[: (1 if smoke else None)], sets, lambda h: _rel_err(h, h_ref))
        hs = [(M.gather_qmm_glu(x, *g, sorted_ids, block_expert, ids, config=cfg_gu),) for (x,) in sets]
        t_dn, cfg_dn = _best(f"{case} BM={bm} down", M.gather_qmm_combine,
                             lambda h: (h, *d, sorted_ids, block_expert, rw),
                             GEMM_CONFIGS[: (1 if smoke else None)], hs, lambda y: _rel_err(y, y_ref))
        if best is None or t_align + t_gu + t_dn < best[0]:
            best = (t_align + t_gu + t_dn, bm, t_align, t_gu, cfg_gu, t_dn, cfg_dn)
    _, bm, t_align, t_gu, cfg_gu, t_dn, cfg_dn = best

    def layer(x):   # what kilnx.ops.moe launches, with the best block height and configs
        sorted_ids, block_expert, _ = align(ids, E, bm)
        h = M.gather_qmm_glu(x, *g, sorted_ids, block_expert, ids, config=cfg_gu)
        return M.gather_qmm_combine(h, *d, sorted_ids, block_expert, rw, config=cfg_dn).to(x.dtype)
    assert _rel_err(layer(sets[0][0]), y_ref) < 3e-2
    t_layer = time_calls(layer, sets, reps=10)

    slots = T * k
    dense = [(torch.randn(slots, H).bfloat16().to(dev), torch.randn(2 * F, H).bfloat16().to(dev),
              torch.randn(slots, F).bfloat16().to(dev), torch.randn(H, F).bfloat16().to(dev))]
    t_cublas = time_calls(lambda a, w1, b, w2: (a @ w1.T, b @ w2.T), dense * 2, reps=10)
    flops = 2 * slots * (2 * F * H + F * H)
    rec.add("moe", case, "tok_s", T / t_layer, "target_10x_mlx_per_layer_tok_s", PREFILL_BAR_TOK_S)
    rec.add("moe", case, "tok_s_default_config", T / t_default, "cublas_bf16_same_flops_tok_s", T / t_cublas)
    rec.add("moe", case, "TFLOPs", flops / t_layer / 1e12, "cublas_bf16_same_flops_TFLOPs", flops / t_cublas / 1e12)
    rec.add("moe", case, "us", t_layer * 1e6, "best_block_m", bm)
    rec.add("moe", case, "us_align", t_align * 1e6)
    rec.add("moe", case, "us_gate_up_swiglu", t_gu * 1e6, "best_config", str(cfg_gu))
    rec.add("moe", case, "us_down_combine", t_dn * 1e6, "best_config", str(cfg_dn))


def _touched_bytes(w: QWeight, ids) -> int:
    """Packed words + scales + biases of the distinct experts a routing uses."""
    per_expert = (w.packed[0].numel() * 4 + w.scales[0].numel() * w.scales.element_size()
                  + w.biases[0].numel() * w.biases.element_size())
    return int(ids.unique().numel()) * per_expert


def _bench_decode(rec, case, T, shape, gu, dn, dense, configs, dev, copy_bw, smoke):
    """Times the decode path; returns the best (gate_up, down) configs."""
    E, k, H = shape["E"], shape["top_k"], shape["hidden"]
    torch.manual_seed(2)
    one = _touched_bytes(gu, torch.arange(T * k)) + _touched_bytes(dn, torch.arange(T * k))
    n = copies_for(one, smoke)
    order = torch.randperm(E)
    sets = []   # each copy routes to the next experts in a shuffled order: no two copies share L2 lines
    for i in range(n):
        ids = order[(torch.arange(T * k) + i * T * k) % E].reshape(T, k).to(dev)
        sets.append((torch.randn(T, H).bfloat16().to(dev), ids,
                     torch.softmax(torch.randn(T, k), dim=-1).bfloat16().to(dev)))
    nbytes = sum(_touched_bytes(gu, ids) + _touched_bytes(dn, ids) for _, ids, _ in sets) / n
    gu_dense, dn_dense = dense
    x0, ids0, rw0 = sets[0]
    h_ref, y_ref = _reference(x0, gu_dense, dn_dense, ids0, rw0)
    g, d = (gu.packed, gu.scales, gu.biases), (dn.packed, dn.scales, dn.biases)

    t_default = time_calls(lambda x, ids, rw: M.moe(x, gu, dn, ids, rw), sets)
    assert _rel_err(M.moe(x0, gu, dn, ids0, rw0), y_ref) < 3e-2, "kilnx.ops.moe is wrong"
    t_gu, cfg_gu = _best(f"{case} gate_up", M.gather_qmv_glu, lambda x, ids, rw: (x, *g, ids),
                         configs[0], sets, lambda h: _rel_err(h, h_ref))
    hs = [(M.gather_qmv_glu(x, *g, ids, config=cfg_gu), ids, rw) for x, ids, rw in sets]
    t_dn, cfg_dn = _best(f"{case} down", M.gather_qmv_combine, lambda h, ids, rw: (h, *d, ids, rw),
                         configs[1], hs, lambda y: _rel_err(y, y_ref))

    def step(x, ids, rw):
        return M.gather_qmv_combine(M.gather_qmv_glu(x, *g, ids, config=cfg_gu), *d, ids, rw, config=cfg_dn)
    t_step = time_calls(step, sets)

    # peer: the same experts' weights dense in bf16, one cuBLAS GEMV for gate_up and one for down
    peers = []
    for x, ids, _ in sets[: max(2, copies_for(4 * one, smoke))]:
        flat = ids.reshape(-1)
        peers.append((x, gu_dense[flat].reshape(-1, H), torch.randn(T, dn_dense.shape[2] * T * k).bfloat16().to(dev),
                      dn_dense[flat].permute(1, 0, 2).reshape(H, -1)))
    peer_bytes = sum(t.numel() * 2 for t in peers[0][1::2])
    t_cublas = time_calls(lambda x, w1, h, w2: (x @ w1.T, h @ w2.T), peers)
    # the fp32 per-slot GEMVs (kernels/moe.py), as measured in session 2
    rec.add("moe", case, "GBps_f32_gemvs", nbytes / t_step / 1e9, "cublas_bf16_GBps", peer_bytes / t_cublas / 1e9)
    rec.add("moe", case, "us_f32_gemvs", t_step * 1e6, "cublas_bf16_us", t_cublas * 1e6)
    rec.add("moe", case, "us_f32_gate_up_swiglu", t_gu * 1e6, "best_config", str(cfg_gu))
    rec.add("moe", case, "us_f32_down_combine", t_dn * 1e6, "best_config", str(cfg_dn))
    t_h2, t_h2_kernels = _bench_decode_h2(rec, case, sets, gu, dn, h_ref, y_ref, smoke)
    _safe(rec, case + " onepass", lambda: _bench_decode_onepass(rec, case, sets, gu, dn, y_ref, nbytes, copy_bw, smoke))
    rec.add("moe", case, "GBps", nbytes / t_h2 / 1e9, "cublas_bf16_GBps", peer_bytes / t_cublas / 1e9)
    rec.add("moe", case, "pct_of_copy", 100 * nbytes / t_h2 / 1e9 / copy_bw, "copy_GBps", copy_bw)
    rec.add("moe", case, "pct_of_copy_without_preps", 100 * nbytes / t_h2_kernels / 1e9 / copy_bw)
    rec.add("moe", case, "GBps_default_config", nbytes / t_default / 1e9, "touched_MB", nbytes / 1e6)
    rec.add("moe", case, "us", t_h2 * 1e6, "cublas_bf16_us", t_cublas * 1e6)
    return cfg_gu, cfg_dn


H2_CONFIGS = [{"BLOCK_N": bn, "BLOCK_KW": kw, "num_warps": nw, "STAGES": st}
              for bn, kw, nw, st in [(8, 128, 2, 3), (16, 128, 2, 3), (8, 64, 1, 3), (16, 64, 2, 3), (32, 64, 4, 3),
                                     (8, 256, 4, 3), (16, 128, 4, 4), (32, 32, 2, 3), (64, 32, 4, 3), (4, 256, 2, 3),
                                     (32, 128, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (16, 256, 4, 2)]]
# $MOE_H2_CHAIN ("1,2"): the sweep again with each CHAIN (words per fp16 accumulator)
H2_CONFIGS = [{**c, "CHAIN": ch} if ch > 1 else c for ch in [int(v) for v in os.environ.get("MOE_H2_CHAIN", "1").split(",")]
              for c in H2_CONFIGS]


def _bench_decode_h2(rec, case, sets, gu, dn, h_ref, y_ref, smoke):
    """The packed-fp16 decode path (kernels/moe_h2.py, what kilnx.ops.moe runs on the GPU): its two
    GEMVs swept on prepared inputs, then the whole step (prep x, gate_up, prep h, down). Returns
    (seconds per step, seconds of the two GEMVs alone)."""
    from kilnx.kernels import moe_h2 as MH
    from kilnx.kernels import qmv_h2 as QH
    g, d = (gu.packed, gu.scales, gu.biases), (dn.packed, dn.scales, dn.biases)
    t_default = time_calls(lambda x, ids, rw: MH.moe_decode(x, gu, dn, ids, rw), sets)
    preps = [(QH.qmv_h2_prep(x, PER=8, GROUP=GS), ids, rw) for x, ids, rw in sets]
    configs = H2_CONFIGS[: (1 if smoke else None)]
    t_gu, cfg_gu = _best(f"{case} h2 gate_up", MH.gather_qmv_h2_glu, lambda p, ids, rw: (*p, *g, ids),
                         configs, preps, lambda h: _rel_err(h, h_ref))
    hps = [(QH.qmv_h2_prep(MH.gather_qmv_h2_glu(*p, *g, ids, config=cfg_gu), PER=8, GROUP=GS), ids, rw)
           for p, ids, rw in preps]
    t_dn, cfg_dn = _best(f"{case} h2 down", MH.gather_qmv_h2_combine, lambda p, ids, rw: (*p, *d, ids, rw),
                         configs, hps, lambda y: _rel_err(y, y_ref))

    def step(x, ids, rw):
        return MH.moe_decode(x, gu, dn, ids, rw, configs=(cfg_gu, cfg_dn))
    assert _rel_err(step(*sets[0]), y_ref) < 3e-2, "the h2 decode step is wrong"
    t_step = time_calls(step, sets)
    t_prep_x = time_calls(lambda x, ids, rw: QH.qmv_h2_prep(x, PER=8, GROUP=GS), sets)
    rec.add("moe", case, "us_h2_default_config", t_default * 1e6)
    rec.add("moe", case, "us_h2_gate_up_swiglu", t_gu * 1e6, "best_config", str(cfg_gu))
    rec.add("moe", case, "us_h2_down_combine", t_dn * 1e6, "best_config", str(cfg_dn))
    rec.add("moe", case, "us_h2_prep_x", t_prep_x * 1e6)
    return t_step, t_gu + t_dn


# the one-pass decode MoE's sweep (kernels/moe_onepass.py): features per program, chunk words, output rows
# per down step, warps
ONEPASS_CONFIGS = [{"BLOCK_F": f, "BLOCK_KW": kw, "BLOCK_H": bh, "num_warps": nw, "STAGES": 3}
                   for f, kw, bh, nw in [(32, 64, 2048, 8), (16, 64, 2048, 4), (32, 32, 2048, 8), (64, 64, 2048, 8),
                                         (16, 128, 2048, 8), (32, 128, 2048, 8), (16, 64, 2048, 8), (32, 64, 2048, 4),
                                         (32, 64, 256, 8), (32, 64, 512, 8), (64, 32, 128, 8)]]


def _bench_decode_onepass(rec, case, sets, gu, dn, y_ref, nbytes, copy_bw, smoke):
    """The decode MoE in one launch (kernels/moe_onepass.py) on prepared x, as an MoE layer's norm hands
    it over: its default and swept configs (each with the zeroing of its fp32 output), then with the
    cast to bf16 that the two-kernel path's output does not need."""
    from kilnx.kernels import moe_onepass as MO
    from kilnx.kernels import qmv_h2 as QH
    preps = [(QH.qmv_h2_prep(x, PER=8, GROUP=GS), ids, rw) for x, ids, rw in sets]
    args_of = lambda p, ids, rw: (*p, gu.packed, gu.scales, gu.biases, dn.packed, dn.scales, dn.biases, ids, rw)  # noqa: E731
    t_best, cfg = _best(f"{case} onepass", MO.moe_onepass_h2, args_of, ONEPASS_CONFIGS[: (1 if smoke else None)],
                        preps, lambda y: _rel_err(y, y_ref))
    t_default = time_calls(lambda p, ids, rw: MO.moe_onepass_h2(*args_of(p, ids, rw)), preps)
    t_cast = time_calls(lambda p, ids, rw: MO.moe_onepass_h2(*args_of(p, ids, rw), config=cfg).bfloat16(), preps)
    rec.add("moe", case, "us_onepass", t_best * 1e6, "best_config", str(cfg))
    rec.add("moe", case, "pct_of_copy_onepass", 100 * nbytes / t_best / 1e9 / copy_bw, "copy_GBps", copy_bw)
    rec.add("moe", case, "us_onepass_default_config", t_default * 1e6)
    rec.add("moe", case, "us_onepass_with_bf16_cast", t_cast * 1e6)
