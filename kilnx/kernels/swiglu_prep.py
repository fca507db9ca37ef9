"""gate_up's GEMV that ends in the SwiGLU, prepared for down: one launch where a llama MLP ran two.

Why: at decode a llama MLP was three dependent kernels, qmv_h2 on [gate | up] (x prepared by the norm), then
`silu_mul_prep` (kernels/prepared.py: silu(gate) * up written in qmv_h2's input form for down), then down's
GEMV. The middle one moves ~100 KB; what it costs is a launch in the chain and its loads' round trip
(1.76 us a layer of ~70 on the H100, bench/results/profiles/2026-12-06_h100_decode_llama8b_profile_s34.txt).

Here a program owns BLOCK_N / 2 gate rows and the matching up rows (as moe_h2.gather_qmv_h2_glu's programs
do), so it has its h columns' gate and up values itself and applies the SwiGLU in registers. The prep needs
whole quantization groups of h (their largest magnitude, their sum), which span GROUP_OUT / (BLOCK_N / 2)
programs at the GEMV's small row blocks: each program stores its h columns, then counts itself in at its
group block (an acquire-release atomic, kernels/wg_direct.py's "last program finishes" pattern), and the last
program of a block to arrive reads the block's h back (from L2) and writes it prepared. The counters are left
at zero for the next call, so a CUDA graph replays the kernel as it is.

The route takes it at one row where the program count fits one wave (serves()), and there the kernel lets the next
kernel in only after its main loop (kd.launch_dependents; enabled() has the A/Bs). The count's tiles (fewer rows a
program) lost at the kernel already (_default), so the route does not take them.

Bit for bit the two-kernel path: gate and up are rounded to the activation dtype (as qmv_h2's output is)
before the SwiGLU, and h to it before the prep (as silu_mul_prep's is).
"""

from __future__ import annotations

import os

import torch

import kilnx.dsl as kd
from kilnx.kernels import _gemv as gemv
from kilnx.kernels import qmv_h2 as H
from kilnx.kernels.sizes import pow2_at_least, pow2_dividing

TUNE = {"BLOCK_N": kd.pow2(2, 128, default=16), "BLOCK_KW": kd.pow2(8, 512, default=128),
        "num_warps": kd.choice(1, 2, 4, 8, default=2), "STAGES": kd.choice(1, 2, 3, 4, default=3),
        "CHAIN": kd.choice(1, 2, 4, default=2)}


def _specialize(planes, sums, xs, wq, scales, biases, done):
    f = wq.shape[0] // 2
    return {"BITS": 32 // (2 * planes.shape[1]), "GROUP": 2 * planes.shape[1] * planes.shape[2] // scales.shape[1],
            "BLOCK_M": pow2_at_least(planes.shape[0]), "F_DIV": pow2_dividing(f),
            "KW_DIV": pow2_dividing(wq.shape[1]), "LATE_TRIGGER": late_trigger()}


def _key(planes, sums, xs, wq, scales, biases, done, **kw):
    return {"M": planes.shape[0], "N": wq.shape[0], "K": 2 * planes.shape[1] * planes.shape[2], "bits": kw["BITS"],
            "gs": kw["GROUP"], "out": f"{kw['PER_OUT']}x{kw['GROUP_OUT']}"}


def _spec(planes, sums, xs, wq, scales, biases, done, *, BITS, GROUP, PER_OUT, GROUP_OUT, **_):
    """(h, planes, group sums, group scales): qmv_h2's result, the SwiGLU of its halves, h prepared."""
    gate_up = H._spec(planes, sums, xs, wq, scales, biases, BITS=BITS, GROUP=GROUP)
    f = gate_up.shape[1] // 2
    h = (torch.nn.functional.silu(gate_up[:, :f].float()) * gate_up[:, f:].float()).to(gate_up.dtype)
    return (h, *(t.to(planes.device) for t in H._prep_spec(h.float().cpu(), PER=PER_OUT, GROUP=GROUP_OUT)))


def _default(planes, sums, xs, wq, scales, biases, done, *, F_DIV, GROUP_OUT, **_):
    """One row (what the route sends here, serves()): a group of h a program, so no program counts in (the count,
    an acquire-release atomic a program, cost more than silu_mul_prep's launch at every tile of fewer rows on the
    H100: bench/results/2026-12-07_h100_swiglu_prep_s38.csv), 64-word chunks, 4 warps, the probe's best at
    llama-3.2-1b's gate_up. More rows: the config qmv_h2 takes for the same [gate | up] weight (tuned, else its
    default), rows paired differently, one split (the SwiGLU needs whole sums)."""
    if planes.shape[0] == 1 and 2 * GROUP_OUT <= 128:
        return {"BLOCK_N": max(2, min(2 * GROUP_OUT, 2 * F_DIV)), "BLOCK_KW": 64, "num_warps": 4, "STAGES": 3,
                "CHAIN": 2}
    cfg = dict(H.qmv_h2._tuned_config((planes, sums, xs, wq, scales, biases), {}))
    cfg.pop("SPLIT_K", None)
    cfg["BLOCK_N"] = max(2, min(cfg.get("BLOCK_N", 16), 2 * F_DIV))
    return cfg


@kd.kernel(tune=TUNE, key=_key, spec=_spec, default=_default, specialize=_specialize)
def qmv_h2_swiglu_prep(x_planes, x_sums, x_scales, wq, scales, biases, done, *, BITS: kd.constexpr, GROUP: kd.constexpr,
                       PER_OUT: kd.constexpr, GROUP_OUT: kd.constexpr, BLOCK_M: kd.constexpr, F_DIV: kd.constexpr,
                       KW_DIV: kd.constexpr, LATE_TRIGGER: kd.constexpr = True, BLOCK_N, BLOCK_KW, STAGES, CHAIN):
    """Prepared x (M, K; x_planes, x_sums, x_scales: qmv_h2's inputs) and a [gate | up] weight (2F, K) -> (h (M, F)
    in scales' dtype, then h prepared for a weight of PER_OUT codes a word in GROUP_OUT groups: planes, group sums,
    group scales).
    done: int32 counters, at least F / max(GROUP_OUT, BLOCK_N / 2) of them, zero (and left zero)."""
    M = x_planes.shape[0]
    N2, KW = wq.shape
    F, HB = N2 // 2, BLOCK_N // 2
    if F_DIV % HB:
        raise kd.DSLError(f"qmv_h2_swiglu_prep: BLOCK_N / 2 = {HB} rows must divide F (here a multiple of {F_DIV})")
    GB = max(GROUP_OUT, HB)                          # h columns of a prepared block: whole groups
    PROGS = GB // HB                                 # the programs whose h columns make one block
    lane = kd.arange(0, BLOCK_N)
    f = gemv.Frame(N2, KW, WPG=GROUP * BITS // 32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_KW=BLOCK_KW, SPLIT_K=1,
                   N_DIV=BLOCK_N, KW_DIV=KW_DIV, STAGES=STAGES,
                   rows_of=lambda pid: pid * HB + lane % HB + lane // HB * F)       # [gate rows | up rows]
    acc = H.accumulate(f, x_planes, x_sums, x_scales, wq, scales, biases, BITS=BITS, chain=min(CHAIN, f.WPG))
    if LATE_TRIGGER:
        kd.launch_dependents()    # down's programs scheduled for the epilogue, not the whole (one-wave) kernel
    gate, up = kd.halves(kd.reshape(acc, (BLOCK_M, 2, HB)), axis=1)
    gate, up = gate.astype(scales.dtype).f32(), up.astype(scales.dtype).f32()
    pid = kd.program_id(0)
    m = kd.arange(0, BLOCK_M)
    h = kd.output((M, F), scales.dtype, name="h")
    kd.store(h, m[:, None], pid * HB + kd.arange(0, HB)[None, :], kd.silu(gate) * up)
    blk = pid // PROGS
    # the program's h stored before it is read back (by its own other threads: a program that makes a whole block
    # alone read values its threads had not yet stored, on the H100) or its count is published
    kd.barrier()
    last = None
    if PROGS > 1:
        last = kd.atomic_add(done, blk, 1, check=False) == PROGS - 1
    words = blk * (GB // PER_OUT) + kd.arange(0, GB // PER_OUT)
    lo_i, hi_i = H.code_pairs_index(words, PER_OUT)
    # one activation row at a time: the rows' sums as one (rows, groups) tile came out wrong at 4 rows on the H100
    # (triton 3.6) while the planes and scales were right
    prepared = H.prepared_outputs(M, F, PER=PER_OUT, GROUP=GROUP_OUT)
    for r in kd.range(0, M):
        lo, hi = kd.load(h, r, lo_i, mask=last, check=False).f32(), kd.load(h, r, hi_i, mask=last, check=False).f32()
        H.store_prepared_into(prepared, lo, hi, r, blk * (GB // PER_OUT), words, PER=PER_OUT, GROUP=GROUP_OUT,
                              mask=last)
    if PROGS > 1:
        kd.store(done, blk, 0, mask=last, check=False)     # left as found, for the next call
    return (h, *prepared)


def late_trigger() -> bool:
    """Whether the kernel lets down's GEMV be scheduled after its main loop (kd.launch_dependents) rather than at its
    start, where every kernel does: KILNX_SWIGLU_TRIGGER=late (the default) / start."""
    value = os.environ.get("KILNX_SWIGLU_TRIGGER", "late")
    if value not in ("late", "start"):
        raise ValueError(f"KILNX_SWIGLU_TRIGGER={value!r}: expected late or start")
    return value == "late"


def enabled() -> bool:
    """KILNX_FUSED_SWIGLU=0 keeps the two launches where the route would take this kernel (serves()). Measured on the
    H100, llama-3.2-1b decode at prompt 128, arms alternated in one call, two rounds each:
    - triggering the next kernel at the start, as every kernel does
      (bench/results/2026-12-07_h100_e2e_fused_swiglu_arms_s38.csv): with PDL 1582.1 / 1579.3 tok/s against 1643.4 /
      1642.5 for the two launches (-3.8%), with KILNX_PDL=0 1473.3 / 1476.1 against 1424.7 / 1430.0 (+3.3%), though the
      kernels' own time fell (9.68 ms over 16 steps against 9.99,
      profiles/2026-12-07_h100_decode_llama1b_fused_swiglu_s38.txt): down's programs, scheduled as soon as all of
      this one-wave kernel's had started, waited on the SMs through all of it;
    - triggering after the main loop (late_trigger; 2026-12-07_h100_e2e_fused_swiglu_trigger_s38.csv): **1667.6 /
      1668.5 against 1636.0 / 1645.3 (+1.6%)**, the start trigger 1584.2 / 1577.6 in the same call.
    Not yet measured on the H200."""
    return os.environ.get("KILNX_FUSED_SWIGLU", "1") != "0"


def serves(x, w, fmt) -> bool:
    """Whether the route takes qmv_h2_swiglu_prep for prepared x (kernels/prepared.PreparedX) through a single
    [gate | up] QWeight w, with h prepared in `fmt` (PER, GROUP) for down: x prepared for w (qmatmul runs qmv_h2 on
    it), F a multiple of the down's group; and the one-row tile of a group of h a program (_default) in one wave,
    as many programs (F / GROUP) as the GPU has SMs or fewer. Measured on the H100 (the probe's file in _default):
    llama-3.2-1b's gate_up (128 programs) 9.80 us against 11.20 for the GEMV and silu_mul_prep; llama-3.1-8b's (224)
    29.5 against 27.4, so it keeps the two launches, as more rows do (at 4, the tile held 4 x 128 accumulators:
    61.7 us against 19.4). (The CPU's route never prepares x; tests force it there, with 4 SMs.)"""
    from kilnx.kernels.dense_mm import sm_count
    from kilnx.kernels.prepared import PreparedX
    from kilnx.quant import QWeight
    if not (enabled() and isinstance(x, PreparedX) and isinstance(w, QWeight) and fmt is not None):
        return False
    f = w.shape[0] // 2
    return (w.mode == "affine" and len(w.shape) == 2 and w.shape[0] % 2 == 0 and x.shape[0] == 1
            and (32 // w.bits, w.group_size) == x.format and f % fmt[1] == 0 and 2 * fmt[1] <= 128
            and f // fmt[1] <= sm_count(x.planes))


def swiglu_prepared(x, gate_up_parts, down_parts):
    """silu(x @ W_gate^T) * (x @ W_up^T) for prepared x (a PreparedX) and a [gate | up] weight, prepared for down's
    GEMV in one launch: a PreparedX, or None where this kernel does not serve them (one weight, down taking prepared
    h in a format the kernel writes; serves())."""
    from kilnx.kernels.prepared import PreparedX, prepared_format_for
    from kilnx.kernels.wg_direct import tile_counters
    if not isinstance(x, PreparedX) or len(gate_up_parts) != 1:
        return None
    w = gate_up_parts[0]
    f = w.shape[0] // 2
    fmt = prepared_format_for(down_parts, x.shape[0], f, x.device, x.dtype) if enabled() else None
    if not serves(x, w, fmt):
        return None
    per, group = fmt
    _, planes, sums, xs = qmv_h2_swiglu_prep(x.planes, x.sums, x.xs, w.packed, w.scales, w.biases,
                                             tile_counters(x.device, f // group), PER_OUT=per, GROUP_OUT=group)
    return PreparedX(planes, sums, xs, x.dtype)
