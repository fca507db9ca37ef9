"""The decode MoE in one pass: gate_up, activation and down of every (token, slot) in a single launch.

Why: the two-kernel decode MoE (kernels/moe_h2.py: gate_up + activation, a prep of h, down + combine)
spends most of its time at kernel boundaries, not streaming weights: on the H200, qwen3-30b-a3b at one
token, its GEMVs moved 14.2 MB in 7.9 us and 7.0 MB in 5.8 us, 33.5% of the copy ceiling over the step
(bench/results/2026-12-04_h200_moe_s15_packed_default.csv), where each launch pays a ramp and a tail.
Here a program owns HB features of one slot's expert:

- gate_up: its HB gate rows and HB up rows (qmv_h2's packed-fp16 loop over rows gathered from the stack,
  moe_h2._gather_accumulate), then h = act(gate) * up * the slot's routing weight, kept in registers;
- down: h is the program's share of the down GEMV's K: its HB columns of every output row. h is packed
  as qmv_h2's planes are (fp16 pairs divided by the power of two above the block's largest |h|), each
  output row's partial dot is HB/PER words of HFMA2s, and the partials of all programs are added into a
  zeroed fp32 output atomically (the combine over slots happens there too).

A program reads 2 HB rows of gate_up and an (H, HB) column block of down; HB divides down's group, so each
output row's partial uses one scale and one bias. The atomic adds make the sum's order vary from run to
run (fp32, then rounded once by the caller).

Measured on the H200 (session 17, bench/results/2026-12-04_h200_moe_onepass_s17.csv): slower than the two
kernels at every width tried (qwen3-30b-a3b 16.1 against 13.8 us at one token, mixtral-8x7b 112 against 92,
llama-3.1-8b's dense MLP as one expert 62 against 35 for its GEMV chain). ncu at qwen3-30b-a3b's shapes
(bench/results/profiles/2026-12-04_h200_ncu_moe_onepass_s17.txt): 56% of its global sectors are excess
(down's 16-byte pieces of each row) and 18% of the warps it could hold are active. So it is a path the
tuner weighs per stack and device (kernels/moe_decode_route.py), not the default.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd
from kilnx.kernels import qmv_h2 as H
from kilnx.kernels.moe import ACTIVATIONS
from kilnx.kernels.moe_h2 import _frame, _gather_accumulate
from kilnx.kernels.sizes import pow2_at_least, pow2_dividing

BITS_SERVED = H.BITS_SERVED


def _down_transposed(d_packed, d_scales) -> bool:
    """Whether down comes transposed, (E, F / codes per word, H) words and (E, F / group, H) scales (see
    down_transposed), rather than as MLX stores it, (E, H, F / codes per word) and (E, H, F / group): in
    MLX's layout the words and the scales share their middle dim (H), transposed their last; a group is
    never as small as a word's codes, so the two cannot be confused."""
    return d_packed.shape[1] != d_scales.shape[1]


def _formats(planes, scales, wq, d_packed, d_scales):
    """The codes and groups of gate_up (from the prepared planes) and of down (whose K is F, half of gate_up's
    2F rows), and down's layout."""
    per, F = 2 * planes.shape[1], wq.shape[1] // 2
    t = _down_transposed(d_packed, d_scales)
    return {"BITS": 32 // per, "GROUP": per * planes.shape[2] // scales.shape[2],
            "BITS_D": 32 * d_packed.shape[1 if t else 2] // F, "GROUP_D": F // d_scales.shape[1 if t else 2],
            "DOWN_T": t}


def _specialize(planes, sums, xs, wq, scales, biases, d_packed, d_scales, d_biases, expert_ids, *_):
    fmt = _formats(planes, scales, wq, d_packed, d_scales)
    return {**fmt, "SLOTS": pow2_at_least(expert_ids.shape[1]),
            "N_DIV": pow2_dividing(wq.shape[1]), "KW_DIV": pow2_dividing(wq.shape[2]),
            "H_DIV": pow2_dividing(d_packed.shape[2 if fmt["DOWN_T"] else 1])}


def _key(planes, sums, xs, wq, scales, biases, d_packed, d_scales, d_biases, expert_ids, *_, **kw):
    return {"M": expert_ids.numel(), "N": wq.shape[1], "K": 2 * planes.shape[1] * planes.shape[2], "E": wq.shape[0],
            "bits": kw["BITS"], "gs": kw["GROUP"], "down": "t" if kw["DOWN_T"] else "n"}


def _default(planes, *args, GROUP_D, N_DIV, **__):
    """Untuned: 32 features (64 gate_up rows) per program, 64 words per chunk, down in blocks of 512 output
    rows, 8 warps, loads 3 deep (fewer features where down's group or the width needs it). The best of the
    configs swept on the H200 at qwen3-30b-a3b, mixtral-8x7b and llama-3.1-8b's MLP widths, and what a
    33-trial tune found at qwen3-30b-a3b's (21.4 us against 25.3 for the first default; bench/results/
    2026-12-04_h200_moe_onepass_s17.csv, 2026-12-04_h200_tune_s17_moe.csv)."""
    return {"BLOCK_F": max(8, min(32, GROUP_D, N_DIV // 2)), "BLOCK_KW": 64, "BLOCK_H": 512 if planes.is_cuda else 64,
            "num_warps": 8, "STAGES": 3, "CHAIN": 1}


TUNE = {"BLOCK_F": kd.pow2(8, 128, default=32), "BLOCK_KW": kd.pow2(8, 512, default=64),
        "BLOCK_H": kd.pow2(16, 4096, default=64), "num_warps": kd.choice(1, 2, 4, 8, default=4),
        "STAGES": kd.choice(1, 2, 3, 4, default=3), "CHAIN": kd.choice(1, 2, 4, default=1)}


def _spec(planes, sums, xs, wq, scales, biases, d_packed, d_scales, d_biases, expert_ids, routing_weights, *, BITS,
          GROUP, BITS_D, GROUP_D, DOWN_T=False, ACT="silu", **_):
    """float64 eager torch: sum_k w[t, k] * down_e(act(gate_e x_t) * up_e x_t), e = expert_ids[t, k]; fp32."""
    from kilnx.kernels.moe_specs import TORCH_ACTIVATIONS, gather_formula
    if DOWN_T:
        d_packed, d_scales, d_biases = (t.transpose(1, 2) for t in (d_packed, d_scales, d_biases))
    x = H._x_of(planes, xs)
    T, top_k = expert_ids.shape
    gate, up = gather_formula(x, wq, scales, biases, expert_ids, BITS, GROUP, True).chunk(2, dim=-1)
    h = TORCH_ACTIVATIONS[ACT](gate) * up * routing_weights.detach().cpu().double().reshape(-1, 1)
    y = gather_formula(h, d_packed, d_scales, d_biases, expert_ids, BITS_D, GROUP_D, False)
    return y.reshape(T, top_k, -1).sum(1).to(torch.float32).to(planes.device)


@kd.kernel(tune=TUNE, key=_key, spec=_spec, default=_default, specialize=_specialize)
def moe_onepass_h2(planes, sums, xs, wq, scales, biases, d_packed, d_scales, d_biases, expert_ids, routing_weights, *,
                   BITS: kd.constexpr, GROUP: kd.constexpr, BITS_D: kd.constexpr, GROUP_D: kd.constexpr,
                   SLOTS: kd.constexpr, N_DIV: kd.constexpr, KW_DIV: kd.constexpr, H_DIV: kd.constexpr,
                   DOWN_T: kd.constexpr = False, ACT: kd.constexpr = "silu", BLOCK_F, BLOCK_KW, BLOCK_H, STAGES,
                   CHAIN):
    """Prepared x (T rows), a [gate | up] stack wq (E, 2F, K) and a down stack (E, H, F) (or transposed,
    DOWN_T) -> (T, H) fp32: sum_k routing_weights[t, k] * down_e(act(gate_e x_t) * up_e x_t), e =
    expert_ids[t, k]."""
    T, TOP_K = expert_ids.shape
    E, N2, KW = wq.shape
    HD = d_packed.shape[2] if DOWN_T else d_packed.shape[1]
    F, HB = N2 // 2, BLOCK_F
    PER_D = 32 // BITS_D
    HBW = HB // PER_D                                # down's words per row in the program's block
    if (N_DIV // 2) % HB or HB % PER_D or GROUP_D % HB:
        raise kd.DSLError(f"moe_onepass_h2: BLOCK_F {HB} must divide the features (here a multiple of "
                          f"{N_DIV // 2}) and down's group ({GROUP_D}) and be a multiple of its {PER_D} codes per word")
    blocks = F // HB                                 # programs per slot
    f = _frame(wq, T * TOP_K * N2, 2 * HB, BLOCK_KW, STAGES, BITS, GROUP, KW_DIV)
    slot, blk = kd.program_id(0) // blocks, kd.program_id(0) % blocks
    token, k = slot // TOP_K, slot % TOP_K
    rows = blk * HB + kd.arange(0, HB)[None, :] + kd.arange(0, 2)[:, None] * F     # [gate rows; up rows]
    expert = kd.load(expert_ids, token, k)
    wcol = blk * HBW + kd.arange(0, HBW)
    g = (blk * HB) // GROUP_D
    check = H_DIV % BLOCK_H != 0

    def down_block(n):
        """(words, scales, biases) of output rows n in the program's column block of the expert's down. In
        MLX's layout a row's words for the block are a 4-16 byte piece of a longer row, so each 32-byte
        sector read is partly wasted (ncu, session 17: 56% of the kernel's sectors); transposed, the
        block's rows are adjacent for each word."""
        if DOWN_T:
            words = kd.load(d_packed, expert, wcol[None, :], n[:, None], hint="stream", check=(False, False, check))
            return (words, kd.load(d_scales, expert, g, n, check=(False, False, check)).f32(),
                    kd.load(d_biases, expert, g, n, check=(False, False, check)).f32())
        words = kd.load(d_packed, expert, n[:, None], wcol[None, :], hint="stream", check=(False, check, False))
        return (words, kd.load(d_scales, expert, n, g, check=(False, check, False)).f32(),
                kd.load(d_biases, expert, n, g, check=(False, check, False)).f32())

    acc = _gather_accumulate(f, planes, sums, xs, wq, scales, biases, expert, rows, token, BITS=BITS, CHAIN=CHAIN)
    gate, up = kd.halves(acc, axis=0)
    h = ACTIVATIONS[ACT](gate) * up * kd.load(routing_weights, token, k).f32()       # (HB,) fp32
    # h as down's prepared activations: word w's pair p holds features w*PER_D + p and + PER_D/2
    lo, hi = kd.halves(kd.reshape(h, (HBW, 2, PER_D // 2)), axis=1)
    amax = kd.max(kd.maximum(kd.max(kd.abs(lo), axis=1), kd.max(kd.abs(hi), axis=1)), axis=0, keepdims=True)
    hscale, inv = H._group_scale(amax)                                            # (1,) tiles
    hp = kd.h2_pack(lo * inv, hi * inv)                                            # (HBW, PER_D / 2) u32
    hsum = kd.sum(h, axis=0)
    out = kd.output((T, HD), kd.f32, zero=True)

    def add_partials(n, words, s, b):
        d = None
        for p in kd.static_range(PER_D // 2):
            xp = kd.broadcast_to(kd.pick(hp, p, axis=1)[None, :], (BLOCK_H, HBW))
            pair = H._exact_pair(words, BITS_D, p)
            d = kd.h2_fma(pair, xp, 0) if d is None else kd.h2_fma(pair, xp, d)
        dot = kd.sum(kd.h2_sum(d), axis=1)                                         # (BLOCK_H,) fp32
        kd.atomic_add(out, token, n, s * hscale * dot + b * hsum, check=(False, check), relaxed=True)

    # down's row blocks in a pipelined loop: a block of every row loaded ahead of the gate_up loop measured
    # slower on the H200 (18.8-21.1 us against 16.7 for 512-row blocks, qwen3-30b-a3b at one token,
    # bench/results/2026-12-04_h200_moe_s17_onepass_v2.csv)
    for n0 in kd.range(0, HD, BLOCK_H, stages=STAGES if STAGES > 1 else None):
        n = n0 + kd.arange(0, BLOCK_H)
        add_partials(n, *down_block(n))
    return out


def serves(w_gate_up, w_down) -> bool:
    """The stacks the two-kernel decode serves (moe_h2.serves), with widths in whole 8-feature blocks."""
    from kilnx.kernels import moe_h2
    return w_down.shape[-1] % 8 == 0 and moe_h2.serves(w_gate_up, w_down)


def down_transposed(w_down):
    """The down stack's words, scales and biases as (E, F / codes per word, H) and (E, F / group, H): what
    the one pass reads along output rows (a copy; moe_onepass takes it in place of w_down)."""
    from types import SimpleNamespace
    packed, scales, biases = _transposed(w_down.packed, w_down.scales, w_down.biases)
    return SimpleNamespace(packed=packed, scales=scales, biases=biases)


def _transposed(*stacks):
    return tuple(t.transpose(1, 2).contiguous() for t in stacks)


def moe_onepass(planes, sums, xs, w_gate_up, w_down, expert_ids, routing_weights, activation: str = "silu",
                config=None):
    """Prepared x (T rows, gate_up's format) -> (T, H) fp32: the decode MoE in one launch (plus the zeroing
    of its output). w_down: the QWeight, or its down_transposed copy."""
    gu, dn = w_gate_up, w_down
    return moe_onepass_h2(planes, sums, xs, gu.packed, gu.scales, gu.biases, dn.packed, dn.scales, dn.biases,
                          expert_ids, routing_weights, ACT=activation, config=config)


def make_args(problem: dict, device: str):
    """{T, top_k, E, N (= 2F), K (= H), bits, gs[, down: "t"]} -> moe_onepass_h2's inputs: the gate_up GLU's
    problem (moe_specs), x prepared, and a random down stack (transposed with down "t")."""
    from kilnx.kernels.moe_specs import make_args_for, random_expert_weights
    bits, gs = problem.get("bits", 4), problem.get("gs", 64)
    x, wq, scales, biases, ids, rw = make_args_for(False, True)({**problem, "x": "token"}, "cpu")
    down = random_expert_weights(problem["E"], problem["K"], problem["N"] // 2, bits, gs)
    if problem.get("down") == "t":
        down = _transposed(*down)
    args = (*H._prep_spec(x, PER=32 // bits, GROUP=gs), wq, scales, biases, *down, ids, rw)
    return tuple(a.to(device) for a in args)


def tolerance(args):
    """(rtol, atol): fp16 products through two GEMVs and the GLU, and the two-kernel path's bf16 h, held to
    2^-6 of the largest output (the CPU tests see ~2^-9 for the one pass)."""
    want = moe_onepass_h2.reference(*args)
    return 2e-2, 2 ** -6 * want.abs().max().item() + 1e-6


moe_onepass_h2.tuning(make_args=make_args, problems=[{"T": 1, "top_k": 8, "E": 128, "N": 1536, "K": 2048, "bits": 4,
                                                      "gs": 64}])
moe_onepass_h2.tolerance = tolerance


__all__ = ["moe_onepass_h2", "moe_onepass", "down_transposed", "serves"]
