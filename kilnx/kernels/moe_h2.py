"""The decode MoE on qmv_h2's packed-fp16 GEMV: gate_up + activation, then down + the weighted sum.

Why: the per-slot GEMVs of kernels/moe.py decode and multiply in fp32, ~5.5 instructions per 4-bit code,
which held the fused decode MoE to 15% of the copy ceiling on the H200 (qwen3-30b-a3b, one token:
bench/results/2026-12-02_h200_moe.csv). These take the activations in qmv_h2's prepared form (fp16
pairs scaled per group, qmv_h2_prep) and run qmv_h2's main loop (two codes per instruction) over rows
gathered from the expert stacks:

- gate_up (`gather_qmv_h2_glu`): a program owns BLOCK_N / 2 gate rows and the matching up rows of one
  (token, slot)'s expert, a (2, BLOCK_N / 2) tile of rows loaded from that expert's stack; it applies
  the activation and stores (T * top_k, F).
- up alone + activation (`gather_qmv_h2_act`), for experts without a gate (nemotron-3's relu²): a program owns
  BLOCK_N up rows of one (token, slot)'s expert.
- down (`gather_qmv_h2_combine`): a program owns BLOCK_N / SLOTS output rows of one token for all of its
  top_k slots (tile row r: slot r // (BLOCK_N / SLOTS)), each slot's rows multiplied by that slot's
  prepared activations, then weighted by the routing weights and summed inside the program (no atomics).
"""

from __future__ import annotations

import os

import kilnx.dsl as kd
from kilnx.kernels import _gemv as gemv
from kilnx.kernels import qmv_h2 as H
from kilnx.kernels.moe import ACTIVATIONS, UNGATED
from kilnx.kernels.sizes import pow2_at_least, pow2_dividing

BITS_SERVED = H.BITS_SERVED


def _format(planes, scales):
    per = 2 * planes.shape[1]
    return {"BITS": 32 // per, "GROUP": per * planes.shape[2] // scales.shape[2]}


def _specialize(planes, sums, xs, wq, scales, biases, expert_ids, *_):
    return {**_format(planes, scales), "SLOTS": pow2_at_least(expert_ids.shape[1]),
            "N_DIV": pow2_dividing(wq.shape[1]), "KW_DIV": pow2_dividing(wq.shape[2])}


def _key(planes, sums, xs, wq, scales, biases, expert_ids, *_, **kw):
    return {"M": expert_ids.numel(), "N": wq.shape[1], "K": 2 * planes.shape[1] * planes.shape[2], "E": wq.shape[0],
            "bits": kw["BITS"], "gs": kw["GROUP"]}


def _default(planes, sums, xs, wq, scales, biases, expert_ids, *rest, SLOTS, N_DIV, KW_DIV, **__):
    """The best of a 14-config sweep on the H200 for qwen3-30b-a3b's experts (every config's time in
    bench/results/profiles/2026-12-03_h200_moe_s9.log): gate_up 32 rows (16 gate + 16 up) x 64 words,
    4 warps; down 4 output rows x the slots at one token, 16 at four (more tokens: more programs), 32
    words; loads 3 deep.
    The rows also have to fit the shapes (BLOCK_N a divisor of 2F for the GLU, a multiple of the
    slots for the combine)."""
    if not planes.is_cuda:
        return {"BLOCK_N": min(8, N_DIV) if not rest else SLOTS, "BLOCK_KW": 32, "num_warps": 4, "STAGES": 1}
    if not rest:    # the GLU
        return {"BLOCK_N": min(32, N_DIV), "BLOCK_KW": 64, "num_warps": 4, "STAGES": 3}
    if KW_DIV % 32:
        # rows of words in no multiple of 32 (nemotron-3's down: 1856 codes, 232 words) take masked chunks; there one
        # output row a program, 4 words an fp16 sum, loads unpipelined was the tuner's best at one and four tokens on
        # the H100: 28.3 / 79.1 us against 57.5 / 206.5 for the rule below
        # (bench/results/2026-12-06_h100_tune_nemotron3_decode_s30.csv)
        return {"BLOCK_N": SLOTS, "BLOCK_KW": 64, "CHAIN": 4, "num_warps": 2, "STAGES": 1}
    ob = 4 if expert_ids.shape[0] == 1 else 16
    while ob > 1 and N_DIV % ob:
        ob //= 2
    return {"BLOCK_N": SLOTS * ob, "BLOCK_KW": 32, "num_warps": 2 if ob <= 4 else 4, "STAGES": 3}


TUNE = {"BLOCK_N": kd.pow2(2, 128, default=8), "BLOCK_KW": kd.pow2(8, 512, default=128),
        "num_warps": kd.choice(1, 2, 4, 8, default=2), "STAGES": kd.choice(1, 2, 3, 4, default=3),
        "CHAIN": kd.choice(1, 2, 4, default=1)}


def _spec(planes, sums, xs, wq, scales, biases, expert_ids, *rest, BITS, GROUP, ACT="silu", **_):
    from kilnx.kernels.moe_specs import gather_spec
    x = H._x_of(planes, xs).to(scales.dtype)
    if rest:   # the combine: x rows are slots
        return gather_spec(x, wq, scales, biases, expert_ids, *rest, gemm=False, act=None, combine=True, BITS=BITS,
                           GROUP=GROUP, X_BY_TOKEN=False)
    return gather_spec(x, wq, scales, biases, expert_ids, gemm=False, act=ACT, combine=False, BITS=BITS, GROUP=GROUP,
                       X_BY_TOKEN=True)


def _act_spec(planes, sums, xs, wq, scales, biases, expert_ids, *, BITS, GROUP, ACT="relu2", **_):
    return _spec(planes, sums, xs, wq, scales, biases, expert_ids, BITS=BITS, GROUP=GROUP, ACT=ACT)


def _gather_accumulate(f, planes, sums, xs, wq, scales, biases, expert, rows, x_row, *, BITS: int, CHAIN: int):
    """(A, B) fp32: row rows[a, b] of expert[a]'s weight . prepared activation row x_row[a] (expert and
    x_row: (A, 1) tiles, or scalars shared by all), qmv_h2's loop over rows gathered from the stack.
    Activations are loaded once per tile row a and broadcast over its B weight rows (a load per weight
    row would stage B copies of them through shared memory in a pipelined loop). CHAIN: words per fp16
    accumulator (gemv.Frame.h2_group_dot)."""
    PER = 32 // BITS
    A, B = rows.shape
    e3 = expert[:, :, None] if len(expert.shape) else expert
    x3 = x_row[:, :, None] if len(x_row.shape) else x_row
    r3, check = rows[:, :, None], (False, False, not f.K_IN)
    acc = kd.zeros((A, B), kd.f32)
    for w0 in f.chunks():
        wc = (w0 + kd.arange(0, f.CHUNK))[None, None, :]
        gi = (w0 // f.WPG + kd.arange(0, f.G))[None, None, :]
        words = kd.load(wq, e3, r3, wc, hint="stream", check=check)
        s, b = kd.load(scales, e3, r3, gi, check=check).f32(), kd.load(biases, e3, r3, gi, check=check).f32()
        d, chain = None, min(CHAIN, f.WPG)
        for p in kd.static_range(PER // 2):
            xp = kd.load(planes, x3, p, wc, check=check)
            d = gemv.h2_chain_fma(H._exact_pair(words, BITS, p), xp, d, chain)
        qx_g = kd.reshape(kd.sum(kd.reshape(kd.h2_sum(d), (A * B * f.G, f.WPG // chain)), axis=1), (A, B, f.G))
        xs_g, sums_g = kd.load(xs, x3, gi, check=check[1:]), kd.load(sums, x3, gi, check=check[1:])
        acc += kd.sum(qx_g * s * xs_g + b * sums_g, axis=2)
    return acc


def _frame(wq, rows, BLOCK_N, BLOCK_KW, STAGES, BITS, GROUP, KW_DIV):
    """The grid and chunk loop (the weight rows are gathered by the kernels themselves)."""
    return gemv.Frame(rows, wq.shape[2], WPG=GROUP * BITS // 32, BLOCK_M=1, BLOCK_N=BLOCK_N, BLOCK_KW=BLOCK_KW,
                      SPLIT_K=1, N_DIV=BLOCK_N, KW_DIV=KW_DIV, STAGES=STAGES)


def _slot_rows(planes, sums, xs, wq, scales, biases, expert_ids, name: str, x_by_token: bool, *, BITS, GROUP, N_DIV,
               KW_DIV, BLOCK_N, BLOCK_KW, STAGES, CHAIN):
    """A program's (slot, its BLOCK_N weight rows (1, BLOCK_N), their (1, BLOCK_N) fp32 dots): the kernels whose
    program owns BLOCK_N rows of one (token, slot)'s expert, x read by token or by slot."""
    T, TOP_K = expert_ids.shape
    N = wq.shape[1]
    if N_DIV % BLOCK_N:
        raise kd.DSLError(f"{name}: BLOCK_N {BLOCK_N} must divide the rows (here a multiple of {N_DIV})")
    blocks = N // BLOCK_N                            # programs per slot
    f = _frame(wq, T * TOP_K * N, BLOCK_N, BLOCK_KW, STAGES, BITS, GROUP, KW_DIV)
    slot, blk = kd.program_id(0) // blocks, kd.program_id(0) % blocks
    cols = blk * BLOCK_N + kd.arange(0, BLOCK_N)[None, :]
    acc = _gather_accumulate(f, planes, sums, xs, wq, scales, biases, kd.load(expert_ids, slot // TOP_K, slot % TOP_K),
                             cols, slot // TOP_K if x_by_token else slot, BITS=BITS, CHAIN=CHAIN)
    return slot, cols, acc


@kd.kernel(tune=TUNE, key=_key, spec=_spec, default=_default, specialize=_specialize)
def gather_qmv_h2_glu(planes, sums, xs, wq, scales, biases, expert_ids, *, BITS: kd.constexpr, GROUP: kd.constexpr,
                      SLOTS: kd.constexpr, N_DIV: kd.constexpr, KW_DIV: kd.constexpr, ACT: kd.constexpr = "silu",
                      BLOCK_N, BLOCK_KW, STAGES, CHAIN):
    """Prepared x (T rows) and a [gate | up] stack wq (E, 2F, K) -> (T * top_k, F) in scales' dtype:
    act(x W_gate^T) * (x W_up^T) per (token, slot)."""
    T, TOP_K = expert_ids.shape
    E, N2, KW = wq.shape
    F, HB = N2 // 2, BLOCK_N // 2
    if N_DIV % BLOCK_N:
        raise kd.DSLError(f"gather_qmv_h2_glu: BLOCK_N {BLOCK_N} must divide 2F (here a multiple of {N_DIV}) "
                          f"with its halves whole")
    blocks = F // HB                                 # programs per slot
    f = _frame(wq, T * TOP_K * N2, BLOCK_N, BLOCK_KW, STAGES, BITS, GROUP, KW_DIV)
    slot, blk = kd.program_id(0) // blocks, kd.program_id(0) % blocks
    rows = blk * HB + kd.arange(0, HB)[None, :] + kd.arange(0, 2)[:, None] * F     # [gate rows; up rows]
    expert = kd.load(expert_ids, slot // TOP_K, slot % TOP_K)
    acc = _gather_accumulate(f, planes, sums, xs, wq, scales, biases, expert, rows, slot // TOP_K,
                             BITS=BITS, CHAIN=CHAIN)
    gate, up = kd.halves(acc, axis=0)
    out = kd.output((T * TOP_K, F), scales.dtype)
    kd.store(out, slot, blk * HB + kd.arange(0, HB), ACTIVATIONS[ACT](gate) * up)
    return out


@kd.kernel(tune=TUNE, key=_key, spec=_act_spec, default=_default, specialize=_specialize)
def gather_qmv_h2_act(planes, sums, xs, wq, scales, biases, expert_ids, *, BITS: kd.constexpr, GROUP: kd.constexpr,
                      SLOTS: kd.constexpr, N_DIV: kd.constexpr, KW_DIV: kd.constexpr, ACT: kd.constexpr = "relu2",
                      BLOCK_N, BLOCK_KW, STAGES, CHAIN):
    """Prepared x (T rows) and an up stack wq (E, F, K) -> (T * top_k, F) in scales' dtype: act(x W_up^T) per
    (token, slot), for an activation of moe.UNGATED."""
    T, TOP_K = expert_ids.shape
    F = wq.shape[1]
    slot, cols, acc = _slot_rows(planes, sums, xs, wq, scales, biases, expert_ids, "gather_qmv_h2_act", True,
                                 BITS=BITS, GROUP=GROUP, N_DIV=N_DIV, KW_DIV=KW_DIV, BLOCK_N=BLOCK_N,
                                 BLOCK_KW=BLOCK_KW, STAGES=STAGES, CHAIN=CHAIN)
    out = kd.output((T * TOP_K, F), scales.dtype)
    kd.store(out, slot, cols, UNGATED[ACT](acc))
    return out


@kd.kernel(tune=TUNE, key=_key, spec=_spec, default=_default, specialize=_specialize)
def gather_qmv_h2_combine(planes, sums, xs, wq, scales, biases, expert_ids, routing_weights, *, BITS: kd.constexpr,
                          GROUP: kd.constexpr, SLOTS: kd.constexpr, N_DIV: kd.constexpr, KW_DIV: kd.constexpr,
                          BLOCK_N, BLOCK_KW, STAGES, CHAIN):
    """Prepared h (T * top_k rows, one per slot) and a stack wq (E, N, F) -> (T, N) in scales' dtype:
    sum_k routing_weights[t, k] * h[t * top_k + k] @ W[expert_ids[t, k]]^T."""
    T, TOP_K = expert_ids.shape
    E, N, KW = wq.shape
    OB = BLOCK_N // SLOTS                            # output rows per program
    if OB == 0 or N_DIV % OB:
        raise kd.DSLError(f"gather_qmv_h2_combine: BLOCK_N {BLOCK_N} must be a multiple of the {SLOTS} slots "
                          f"and BLOCK_N / slots must divide N (here a multiple of {N_DIV})")
    blocks = N // OB
    f = _frame(wq, T * N * SLOTS, BLOCK_N, BLOCK_KW, STAGES, BITS, GROUP, KW_DIV)
    token, blk = kd.program_id(0) // blocks, kd.program_id(0) % blocks
    slot = kd.arange(0, SLOTS)[:, None]
    k = kd.minimum(slot, TOP_K - 1)                  # slots past top_k repeat the last one, weighted 0
    rows = blk * OB + kd.arange(0, OB)[None, :] + slot * 0
    acc = _gather_accumulate(f, planes, sums, xs, wq, scales, biases, kd.load(expert_ids, token, k), rows,
                             token * TOP_K + k, BITS=BITS, CHAIN=CHAIN)
    w = kd.where(slot < TOP_K, kd.load(routing_weights, token, k).f32(), 0.0)
    out = kd.output((T, N), scales.dtype)
    kd.store(out, token, blk * OB + kd.arange(0, OB), kd.sum(acc * w, axis=0))
    return out


def _served(w) -> bool:
    return w.mode == "affine" and w.bits in BITS_SERVED and w.packed.is_cuda


def serves(w_gate_up, w_down) -> bool:
    return _served(w_gate_up) and _served(w_down)


def takes_prepared(x, w_gate_up) -> bool:
    """Whether an MoE layer's norm should hand x (rows, H) to kilnx.ops.moe prepared for these experts'
    gate_up (with the router, kernels/prepared.py): the packed-fp16 decode path would run (GPU, 4/8-bit
    affine, few tokens), unless KILNX_MOE_PREPARED=0. It saves the x prep here and the router GEMV's own
    prep, two launches per MoE layer: qwen3-30b-a3b decode on the H200 501.7 tok/s against 481.9 without
    (bench/results/2026-12-03_h200_e2e_s11_moe_prepared_*.csv)."""
    from kilnx.kernels.moe import MOE_DECODE_MAX_TOKENS
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return os.environ.get("KILNX_MOE_PREPARED", "1") != "0" and _served(w_gate_up) and 0 < rows <= MOE_DECODE_MAX_TOKENS


def moe_decode(x, w_gate_up, w_down, expert_ids, routing_weights, activation: str = "silu", configs=(None, None)):
    """x (T, H) -> (T, H): prep x, gate_up + activation, prep h, down + weighted sum (four launches; three
    when x comes prepared, a kernels.prepared.PreparedX in gate_up's format). configs: the two GEMVs'
    (None: their tuned or default ones). Where kernels/moe_onepass.py serves the stacks, no configs are given
    and the stored path for them (kernels/moe_decode_route.py) is the one pass, the whole MoE after the prep
    is that one launch instead (with its output's zeroing and cast)."""
    from kilnx.kernels.prepared import PreparedX
    gu, dn = w_gate_up, w_down
    if isinstance(x, PreparedX):
        planes, sums, xs = x.planes, x.sums, x.xs
    else:
        planes, sums, xs = H.qmv_h2_prep(x, PER=32 // gu.bits, GROUP=gu.group_size)
    from kilnx.kernels import moe_onepass
    from kilnx.kernels.moe_decode_route import moe_decode_path
    args = (planes, sums, xs, gu.packed, gu.scales, gu.biases, dn.packed, dn.scales, dn.biases, expert_ids,
            routing_weights)
    served = configs == (None, None) and moe_onepass.serves(gu, dn)
    y = moe_decode_path.run(moe_decode_path.path_for(args) if served else "two_kernels", *args,
                            activation=activation, configs=configs)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def two_kernels(planes, sums, xs, wq, scales, biases, d_packed, d_scales, d_biases, expert_ids, routing_weights, *,
                activation: str = "silu", configs=(None, None), backend=None):
    """Prepared x -> (T, H) in scales' dtype: gate_up + activation, the prep of h, down + the weighted sum.

    The first two in one launch (a group of h a program, which stores h, reads it back and preps it; session 38's
    gather_qmv_h2_glu_prep) lost on the H100 at one qwen3-30b-a3b token: 10.0 us against 9.53 for the two kernels,
    the MoE step 18.3 against 15.0, decode 506.4 / 508.7 tok/s against 520.7 / 519.3
    (bench/results/2026-12-07_h100_moe_decode_s39.csv, _e2e_moe_glu_prep_arms_s39.csv); it went in session 39."""
    h = gather_qmv_h2_glu(planes, sums, xs, wq, scales, biases, expert_ids, ACT=activation, config=configs[0],
                          backend=backend)
    f = h.shape[1]                                           # down's K
    hp = H.qmv_h2_prep(h, PER=f // d_packed.shape[2], GROUP=f // d_scales.shape[2], backend=backend)
    return gather_qmv_h2_combine(*hp, d_packed, d_scales, d_biases, expert_ids, routing_weights, config=configs[1],
                                 backend=backend)


def ungated_decode(x, w_up, w_down, expert_ids, routing_weights, activation: str = "relu2", backend=None):
    """x (T, H) plain -> (T, H) in x.dtype for experts without a gate: prep x, up + activation, prep h, down +
    the weighted sum (four launches, as two_kernels runs a gated layer)."""
    planes, sums, xs = H.qmv_h2_prep(x, PER=32 // w_up.bits, GROUP=w_up.group_size, backend=backend)
    h = gather_qmv_h2_act(planes, sums, xs, w_up.packed, w_up.scales, w_up.biases, expert_ids, ACT=activation,
                          backend=backend)
    hp = H.qmv_h2_prep(h, PER=32 // w_down.bits, GROUP=w_down.group_size, backend=backend)
    # the down as one combine launch: per slot then a sum (a second launch) decoded 0.95x as fast on the H100
    # (nemotron-3-nano-30b-a3b, 424.8 / 425.3 tok/s against 445.1 / 445.0, two rounds alternated in one call,
    # bench/results/2026-12-07_h100_e2e_nemotron3_moe_down_s38.csv) and was dropped
    y = gather_qmv_h2_combine(*hp, w_down.packed, w_down.scales, w_down.biases, expert_ids, routing_weights,
                              backend=backend)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def make_args(problem: dict, device: str):
    """{T, top_k, E, N, K, bits, gs, x}: the prepared activations of the gather kernels' problem."""
    from kilnx.kernels.moe_specs import make_args_for
    weighted = problem.get("x") == "slot"
    args = make_args_for(False, weighted)(problem, "cpu")
    PER = 32 // problem.get("bits", 4)
    prepared = H._prep_spec(args[0], PER=PER, GROUP=problem.get("gs", 64))
    return tuple(a.to(device) for a in (*prepared, *args[1:]))


def _tolerance(glu: bool):
    def tol(args):
        from kilnx.kernels.moe_specs import gather_tolerance
        x = H._x_of(args[0], args[2])
        return gather_tolerance((x, *args[3:]), glu=glu)
    return tol


def register_tuning():
    from kilnx.kernels.moe_specs import problems_by_kernel
    problems = problems_by_kernel()
    # the ungated kernel's product is squared (relu²): its error scales as a GLU's does
    for kernel, glu in ((gather_qmv_h2_glu, True), (gather_qmv_h2_combine, False), (gather_qmv_h2_act, True)):
        kernel.tuning(make_args=make_args, problems=problems[kernel.name])
        kernel.tolerance = _tolerance(glu)
        kernel.seed_configs = lambda problem: [
            {"BLOCK_N": bn, "BLOCK_KW": kw, "num_warps": nw, "STAGES": st}
            for bn, kw, nw, st in [(32, 64, 4, 3), (32, 32, 2, 3), (64, 32, 4, 3), (128, 32, 4, 3), (8, 128, 2, 3),
                                   (16, 64, 2, 3)]]


register_tuning()

__all__ = ["gather_qmv_h2_glu", "gather_qmv_h2_act", "gather_qmv_h2_combine", "moe_decode", "ungated_decode", "serves",
           "two_kernels"]
