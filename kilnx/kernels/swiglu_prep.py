"""gate_up's GEMV that ends in the SwiGLU, prepared for down: one launch where a llama MLP ran two.

Why: at decode a llama MLP was three dependent kernels, qmv_h2 on [gate | up] (x prepared by the norm), then
`silu_mul_prep` (kernels/prepared.py: silu(gate) * up written in qmv_h2's input form for down), then down's
GEMV. The middle one moves ~100 KB; what it costs is a launch in the chain and its loads' round trip
(1.76 us a layer of ~70 on the H100, bench/results/profiles/2026-12-06_h100_decode_llama8b_profile_s34.txt).

Here a program owns BLOCK_N / 2 gate rows and the matching up rows (as moe_h2.gather_qmv_h2_glu's programs
do), so it has its h columns' gate and up values itself and applies the SwiGLU in registers; its h columns are
whole quantization groups of h (their largest magnitude, their sum), so it preps them itself: it stores h and
reads it back in the prep's order. Tiles of fewer rows, a group spread over programs whose last one to finish
(an acquire-release count) prepped it, cost more than silu_mul_prep's launch at every size tried on the H100
(bench/results/2026-12-07_h100_swiglu_prep_s38.csv) and were dropped.

The route takes it at one row where the programs fit one wave (serves()), and the kernel lets the next kernel in
only after its main loop (kd.launch_dependents; enabled() has the A/Bs).

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


def _specialize(planes, sums, xs, wq, scales, biases):
    return {"BITS": 32 // (2 * planes.shape[1]), "GROUP": 2 * planes.shape[1] * planes.shape[2] // scales.shape[1],
            "BLOCK_M": pow2_at_least(planes.shape[0]), "F_DIV": pow2_dividing(wq.shape[0] // 2),
            "KW_DIV": pow2_dividing(wq.shape[1])}


def _key(planes, sums, xs, wq, scales, biases, **kw):
    return {"M": planes.shape[0], "N": wq.shape[0], "K": 2 * planes.shape[1] * planes.shape[2], "bits": kw["BITS"],
            "gs": kw["GROUP"], "out": f"{kw['PER_OUT']}x{kw['GROUP_OUT']}"}


def _spec(planes, sums, xs, wq, scales, biases, *, BITS, GROUP, PER_OUT, GROUP_OUT, **_):
    """(h, planes, group sums, group scales): qmv_h2's result, the SwiGLU of its halves, h prepared."""
    gate_up = H._spec(planes, sums, xs, wq, scales, biases, BITS=BITS, GROUP=GROUP)
    f = gate_up.shape[1] // 2
    h = (torch.nn.functional.silu(gate_up[:, :f].float()) * gate_up[:, f:].float()).to(gate_up.dtype)
    return (h, *(t.to(planes.device) for t in H._prep_spec(h.float().cpu(), PER=PER_OUT, GROUP=GROUP_OUT)))


def _default(planes, *_, GROUP_OUT, **__):
    """A group of h a program, 64-word chunks, 4 warps, loads 3 deep: the probe's best at llama-3.2-1b's gate_up on
    the H100 (9.73 us against 11.24 for the two launches)."""
    return {"BLOCK_N": 2 * GROUP_OUT, "BLOCK_KW": 64, "num_warps": 4, "STAGES": 3 if planes.is_cuda else 1, "CHAIN": 2}


@kd.kernel(tune=TUNE, key=_key, spec=_spec, default=_default, specialize=_specialize)
def qmv_h2_swiglu_prep(x_planes, x_sums, x_scales, wq, scales, biases, *, BITS: kd.constexpr, GROUP: kd.constexpr,
                       PER_OUT: kd.constexpr, GROUP_OUT: kd.constexpr, BLOCK_M: kd.constexpr, F_DIV: kd.constexpr,
                       KW_DIV: kd.constexpr, BLOCK_N, BLOCK_KW, STAGES, CHAIN):
    """Prepared x (M, K; x_planes, x_sums, x_scales: qmv_h2's inputs) and a [gate | up] weight (2F, K) -> (h (M, F)
    in scales' dtype, then h prepared for a weight of PER_OUT codes a word in GROUP_OUT groups: planes, group sums,
    group scales)."""
    M = x_planes.shape[0]
    N2, KW = wq.shape
    F, HB = N2 // 2, BLOCK_N // 2
    if HB % GROUP_OUT or F_DIV % HB:
        raise kd.DSLError(f"qmv_h2_swiglu_prep: BLOCK_N / 2 = {HB} h columns a program must be whole groups of "
                          f"{GROUP_OUT} and divide F (here a multiple of {F_DIV})")
    lane = kd.arange(0, BLOCK_N)
    f = gemv.Frame(N2, KW, WPG=GROUP * BITS // 32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_KW=BLOCK_KW, SPLIT_K=1,
                   N_DIV=BLOCK_N, KW_DIV=KW_DIV, STAGES=STAGES,
                   rows_of=lambda pid: pid * HB + lane % HB + lane // HB * F)       # [gate rows | up rows]
    acc = H.accumulate(f, x_planes, x_sums, x_scales, wq, scales, biases, BITS=BITS, chain=min(CHAIN, f.WPG))
    kd.launch_dependents()    # down's programs scheduled for the epilogue, not the whole (one-wave) kernel
    gate, up = kd.halves(kd.reshape(acc, (BLOCK_M, 2, HB)), axis=1)
    gate, up = gate.astype(scales.dtype).f32(), up.astype(scales.dtype).f32()
    pid = kd.program_id(0)
    h = kd.output((M, F), scales.dtype, name="h")
    kd.store(h, kd.arange(0, BLOCK_M)[:, None], pid * HB + kd.arange(0, HB)[None, :], kd.silu(gate) * up)
    prepared = H.prepared_outputs(M, F, PER=PER_OUT, GROUP=GROUP_OUT)
    # one activation row at a time: the rows' sums as one (rows, groups) tile came out wrong at 4 rows on the H100
    # (triton 3.6) while the planes and scales were right
    for r in kd.range(0, M):
        H.prepare_stored(h, prepared, r, pid * (HB // PER_OUT), HB // PER_OUT, PER=PER_OUT, GROUP=GROUP_OUT)
    return (h, *prepared)


def enabled() -> bool:
    """KILNX_FUSED_SWIGLU=0 keeps the two launches where the route would take this kernel (serves()). Measured on the
    H100, llama-3.2-1b decode at prompt 128, arms alternated in one call, two rounds each:
    - triggering the next kernel at the start, as every kernel does
      (bench/results/2026-12-07_h100_e2e_fused_swiglu_arms_s38.csv): with PDL 1582.1 / 1579.3 tok/s against 1643.4 /
      1642.5 for the two launches (-3.8%), with KILNX_PDL=0 1473.3 / 1476.1 against 1424.7 / 1430.0 (+3.3%), though the
      kernels' own time fell (9.68 ms over 16 steps against 9.99,
      profiles/2026-12-07_h100_decode_llama1b_fused_swiglu_s38.txt): down's programs, scheduled as soon as all of
      this one-wave kernel's had started, waited on the SMs through all of it;
    - triggering after the main loop (2026-12-07_h100_e2e_fused_swiglu_trigger_s38.csv; the other arm's switch,
      KILNX_SWIGLU_TRIGGER=start, went in session 38's review): **1667.6 /
      1668.5 against 1636.0 / 1645.3 (+1.6%)**, the start trigger 1584.2 / 1577.6 in the same call.
    Not yet measured on the H200."""
    return os.environ.get("KILNX_FUSED_SWIGLU", "1") != "0"


def serves(x, w, fmt) -> bool:
    """Whether the route takes qmv_h2_swiglu_prep for prepared x (kernels/prepared.PreparedX) through a single
    [gate | up] QWeight w, with h prepared in `fmt` (PER, GROUP) for down: x prepared for w (qmatmul runs qmv_h2 on
    it), one row, F a multiple of the down's group, and its programs (a group of h each, F / GROUP of them) no more
    than the GPU's SMs: one wave. Measured on the H100 (the probe's file in the module doc): llama-3.2-1b's gate_up
    (128 programs) 9.73 us against 11.24 for the GEMV and silu_mul_prep; llama-3.1-8b's (224) 28.6 against 26.9, so
    it keeps the two launches, as more rows do (at 4, the tile held 4 x 128 accumulators: 61.7 us against 19.4). Taken
    past one wave anyway (session 39, an A/B switch since gone), llama-3.1-8b decoded 445.6 / 446.3 tok/s against 456.9
    / 459.8 on the H100 (bench/results/2026-12-07_h100_e2e_trigger_arms_8b_s39.csv, arm `any`).
    (The CPU's route never prepares x; tests force it there, with 4 SMs.)"""
    from kilnx.kernels.dense_mm import sm_count
    from kilnx.kernels.prepared import PreparedX
    from kilnx.quant import QWeight
    if not (isinstance(x, PreparedX) and isinstance(w, QWeight) and fmt is not None):
        return False
    f = w.shape[0] // 2
    return (w.mode == "affine" and len(w.shape) == 2 and w.shape[0] % 2 == 0 and x.shape[0] == 1
            and (32 // w.bits, w.group_size) == x.format and f % fmt[1] == 0 and 2 * fmt[1] <= 128
            and f // fmt[1] <= sm_count(x.planes))


def swiglu_prepared(x, gate_up_parts, down_parts):
    """silu(x @ W_gate^T) * (x @ W_up^T) for prepared x (a PreparedX) and a [gate | up] weight, prepared for down's
    GEMV in one launch: a PreparedX, or None where this kernel does not serve them (enabled(), serves())."""
    from kilnx.kernels.prepared import PreparedX, prepared_format_for
    if not (enabled() and isinstance(x, PreparedX) and len(gate_up_parts) == 1):
        return None
    w = gate_up_parts[0]
    fmt = prepared_format_for(down_parts, x.shape[0], w.shape[0] // 2, x.device, x.dtype)
    if not serves(x, w, fmt):
        return None
    _, planes, sums, xs = qmv_h2_swiglu_prep(x.planes, x.sums, x.xs, w.packed, w.scales, w.biases, PER_OUT=fmt[0],
                                             GROUP_OUT=fmt[1])
    return PreparedX(planes, sums, xs, x.dtype)
