"""The decode MoE's gate_up + activation writing h prepared for down: one launch where moe_h2.two_kernels runs two.

Why: moe_h2.two_kernels runs gather_qmv_h2_glu (h per (token, slot) in the activation dtype), then qmv_h2_prep on h,
then the combine; the prep was 1.2 us of the 15.0 us a qwen3-30b-a3b MoE layer took at one token on the H200
(bench/results/2026-12-07_h200_moe_s37.csv). Here a program owns a whole quantization group of h columns of one
slot (BLOCK_N / 2 = GROUP_OUT: 64 gate rows and the matching up rows), so it preps its own h: no count across
programs (which lost to the separate launch in the dense case, kernels/swiglu_prep.py). At one token of qwen3-30b-a3b
that is 8 slots x 12 programs, one wave; the kernel lets the combine in after its main loop (kd.launch_dependents),
as swiglu_prep does (a one-wave kernel triggering at its start kept the next kernel's programs waiting on the SMs
through all of it: -3.8% of llama-3.2-1b decode on the H100; after its loop +1.6%).

Off unless KILNX_MOE_GLU_PREP=1: not yet run on a GPU (session 38 had no device time left).
Bit for bit the two launches: h is rounded to the activation dtype before the prep, as the stored h was.
"""

from __future__ import annotations

import os

import kilnx.dsl as kd
from kilnx.kernels import moe_h2 as MH
from kilnx.kernels import qmv_h2 as H
from kilnx.kernels.moe import ACTIVATIONS
from kilnx.kernels.sizes import pow2_at_least, pow2_dividing


def _specialize(x_planes, x_sums, x_scales, wq, scales, biases, expert_ids):
    return {"BITS": 32 // (2 * x_planes.shape[1]),
            "GROUP": 2 * x_planes.shape[1] * x_planes.shape[2] // scales.shape[2],
            "SLOTS": pow2_at_least(expert_ids.shape[1]), "F_DIV": pow2_dividing(wq.shape[1] // 2),
            "KW_DIV": pow2_dividing(wq.shape[2])}


def _key(x_planes, x_sums, x_scales, wq, scales, biases, expert_ids, **kw):
    return {"M": expert_ids.numel(), "N": wq.shape[1], "K": 2 * x_planes.shape[1] * x_planes.shape[2],
            "E": wq.shape[0], "bits": kw["BITS"], "gs": kw["GROUP"], "out": f"{kw['PER_OUT']}x{kw['GROUP_OUT']}"}


def _spec(x_planes, x_sums, x_scales, wq, scales, biases, expert_ids, *, BITS, GROUP, PER_OUT, GROUP_OUT, ACT="silu",
          **_):
    """(h (T * top_k, F), its planes, group sums, group scales): gather_qmv_h2_glu's result, prepared."""
    h = MH.gather_qmv_h2_glu.reference(x_planes, x_sums, x_scales, wq, scales, biases, expert_ids, ACT=ACT)
    return (h, *(t.to(x_planes.device) for t in H._prep_spec(h.float().cpu(), PER=PER_OUT, GROUP=GROUP_OUT)))


def _default(x_planes, *_, GROUP_OUT, **__):
    """A group of h a program (64 gate + 64 up rows at group 64), 64-word chunks, 4 warps, loads 3 deep: the dense
    one-row kernel's tile (kernels/swiglu_prep.py), a guess here until a GPU times it."""
    return {"BLOCK_N": 2 * GROUP_OUT, "BLOCK_KW": 64, "num_warps": 4, "STAGES": 3 if x_planes.is_cuda else 1,
            "CHAIN": 2}


@kd.kernel(tune=MH.TUNE, key=_key, spec=_spec, default=_default, specialize=_specialize)
def gather_qmv_h2_glu_prep(x_planes, x_sums, x_scales, wq, scales, biases, expert_ids, *, BITS: kd.constexpr,
                           GROUP: kd.constexpr, SLOTS: kd.constexpr, F_DIV: kd.constexpr, KW_DIV: kd.constexpr,
                           PER_OUT: kd.constexpr, GROUP_OUT: kd.constexpr, ACT: kd.constexpr = "silu",
                           BLOCK_N, BLOCK_KW, STAGES, CHAIN):
    """Prepared x (T rows) and a [gate | up] stack wq (E, 2F, K) -> (h (T * top_k, F) in scales' dtype, then h
    prepared for a down of PER_OUT codes a word in GROUP_OUT groups: planes, group sums, group scales)."""
    T, TOP_K = expert_ids.shape
    E, N2, KW = wq.shape
    F, HB = N2 // 2, BLOCK_N // 2
    if HB % GROUP_OUT or F_DIV % HB:
        raise kd.DSLError(f"gather_qmv_h2_glu_prep: BLOCK_N / 2 = {HB} h columns a program must be whole groups of "
                          f"{GROUP_OUT} and divide F (here a multiple of {F_DIV})")
    blocks = F // HB                                 # programs per slot
    f = MH._frame(wq, T * TOP_K * N2, BLOCK_N, BLOCK_KW, STAGES, BITS, GROUP, KW_DIV)
    slot, blk = kd.program_id(0) // blocks, kd.program_id(0) % blocks
    rows = blk * HB + kd.arange(0, HB)[None, :] + kd.arange(0, 2)[:, None] * F     # [gate rows; up rows]
    expert = kd.load(expert_ids, slot // TOP_K, slot % TOP_K)
    acc = MH._gather_accumulate(f, x_planes, x_sums, x_scales, wq, scales, biases, expert, rows, slot // TOP_K,
                                BITS=BITS, CHAIN=CHAIN)
    kd.launch_dependents()    # the combine's programs scheduled for the epilogue, not the whole (one-wave) kernel
    gate, up = kd.halves(acc, axis=0)
    h = kd.output((T * TOP_K, F), scales.dtype, name="h")
    kd.store(h, slot, blk * HB + kd.arange(0, HB), ACTIVATIONS[ACT](gate) * up)
    prepared = H.prepared_outputs(T * TOP_K, F, PER=PER_OUT, GROUP=GROUP_OUT)
    H.prepare_stored(h, prepared, slot, blk * (HB // PER_OUT), HB // PER_OUT, PER=PER_OUT, GROUP=GROUP_OUT)
    return (h, *prepared)


def enabled() -> bool:
    """KILNX_MOE_GLU_PREP=1 lets moe_h2.two_kernels take gather_qmv_h2_glu_prep (serves())."""
    return os.environ.get("KILNX_MOE_GLU_PREP", "0") == "1"


def serves(wq, d_scales, configs) -> bool:
    """Whether two_kernels takes this kernel for a [gate | up] stack wq (E, 2F, K) and down's group scales: the
    switch on, no configs forced on the two kernels, down's groups of at most 64 (the tile's 128 rows) dividing F."""
    f = wq.shape[1] // 2
    group_out = f // d_scales.shape[2] if d_scales.shape[2] else 0
    return enabled() and configs == (None, None) and 0 < group_out <= 64 and f % group_out == 0


def glu_prepared(planes, sums, xs, wq, scales, biases, expert_ids, d_packed, d_scales, activation, backend=None):
    """(planes, group sums, group scales) of the activated h, prepared for down (d_packed, d_scales)."""
    f = wq.shape[1] // 2
    _, *hp = gather_qmv_h2_glu_prep(planes, sums, xs, wq, scales, biases, expert_ids,
                                    PER_OUT=f // d_packed.shape[2], GROUP_OUT=f // d_scales.shape[2], ACT=activation,
                                    backend=backend)
    return hp
