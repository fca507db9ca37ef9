"""The MoE align step: (token, slot) pairs grouped by expert, each expert's run padded to BLOCK_M.

Routing gives expert_ids (T, top_k). A grouped GEMM wants, instead, blocks of BLOCK_M rows that all
use one expert. `align` writes (into caller-allocated buffers, so a CUDA graph can reuse them):

  sorted_ids    (capacity,) int32: flat slot indices i = t * top_k + k, grouped by expert (experts in
                ascending order, slots in ascending order within an expert); each expert's run is
                padded to a multiple of BLOCK_M with the sentinel T * top_k, and so is everything
                past the last run. The sentinel is one past the last slot, so a bounds-checked load
                or store at it reads nothing and writes nothing.
  block_expert  (capacity / BLOCK_M,) int32: the expert of each block; -1 for blocks past the end.
  expert_offsets (E + 1,) int32: where each expert's run starts; [E] = the padded total.

capacity = numel + min(E, numel) * (BLOCK_M - 1) rounded up to BLOCK_M: at most min(E, numel)
experts are used, each wasting at most BLOCK_M - 1 rows. So BLOCK_M = capacity // len(block_expert)
and E = len(expert_offsets) - 1 follow from the buffers' shapes: the kernel needs no other argument.

One program per expert, no atomics (the result is deterministic): it counts every expert's slots
(an E x numel comparison, in tiles) to get its own offset, then scans the slots again and scatters
its own, ranked by an exclusive prefix count inside each chunk.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd
from kilnx.kernels.rope import InPlaceAsOutputs

# A grouped GEMM tile is at least 16 rows (tensor cores). Larger tiles pay off once experts see many
# slots each; past 64 the padding of lightly-used experts dominates. Refined by measurement later.
ALIGN_BLOCK_M_MIN, ALIGN_BLOCK_M_MAX = 16, 64


def align_block_m(num_slots: int, num_experts: int) -> int:
    """Rows per grouped-GEMM tile for this routing size: the mean slots per expert, as a power of two
    within [ALIGN_BLOCK_M_MIN, ALIGN_BLOCK_M_MAX]."""
    mean = max(num_slots // max(num_experts, 1), 1)
    return min(max(1 << (mean - 1).bit_length(), ALIGN_BLOCK_M_MIN), ALIGN_BLOCK_M_MAX)


def align_capacity(num_slots: int, num_experts: int, block_m: int) -> int:
    worst = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return -(-worst // block_m) * block_m


def align_buffers(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    """Uninitialised (sorted_ids, block_expert, expert_offsets) for `moe_align` to fill."""
    cap = align_capacity(expert_ids.numel(), num_experts, block_m)
    new = lambda n: torch.empty(n, dtype=torch.int32, device=expert_ids.device)  # noqa: E731
    return new(cap), new(cap // block_m), new(num_experts + 1)


def align_formula(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    """The meaning of the align step in eager torch: (sorted_ids, block_expert, expert_offsets)."""
    flat = expert_ids.reshape(-1).long().cpu()
    numel = flat.numel()
    sorted_ids, block_expert, offsets = (t.cpu() for t in align_buffers(flat, num_experts, block_m))
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)                     # slots grouped by expert, in order
    expert_of = flat[order]
    first_in_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(numel) - first_in_expert[expert_of]
    sorted_ids.fill_(numel)
    sorted_ids[starts[expert_of] + rank] = order.to(torch.int32)
    block_expert.fill_(-1)
    used = torch.repeat_interleave(torch.arange(num_experts), padded // block_m)
    block_expert[:used.numel()] = used.to(torch.int32)
    offsets[:num_experts] = starts.to(torch.int32)
    offsets[num_experts] = int(padded.sum())
    dev = expert_ids.device
    return sorted_ids.to(dev), block_expert.to(dev), offsets.to(dev)


def _align_spec(expert_ids, sorted_ids, block_expert, expert_offsets, *, BLOCK_M, **_):
    return align_formula(expert_ids, expert_offsets.shape[0] - 1, BLOCK_M)


def _align_key(expert_ids, sorted_ids, block_expert, expert_offsets, *, BLOCK_M, **_):
    return {"T": expert_ids.shape[0], "top_k": expert_ids.shape[1], "E": expert_offsets.shape[0] - 1,
            "BM": BLOCK_M}


@InPlaceAsOutputs.of(mutated=(1, 2, 3))
@kd.kernel(
    tune={"BLOCK_E": kd.pow2(16, 256, default=128), "BLOCK_T": kd.pow2(16, 256, default=64),
          "num_warps": kd.choice(1, 2, 4, 8, default=4)},
    key=_align_key, spec=_align_spec,
    specialize=lambda ids, sorted_ids, block_expert, offs: {"BLOCK_M": sorted_ids.shape[0] // block_expert.shape[0]})
def moe_align(expert_ids, sorted_ids, block_expert, expert_offsets, *, BLOCK_M: kd.constexpr, BLOCK_E, BLOCK_T):
    T, TOP_K = expert_ids.shape
    numel = T * TOP_K
    E = expert_offsets.shape[0] - 1
    expert = kd.grid(E)
    lane = kd.arange(0, BLOCK_T)

    # every expert's padded size: this expert's start is the sum over the experts before it
    start = kd.zeros((), kd.i32)
    count = kd.zeros((), kd.i32)
    total = kd.zeros((), kd.i32)
    for e0 in kd.range(0, E, BLOCK_E):
        experts = e0 + kd.arange(0, BLOCK_E)
        counts = kd.zeros((BLOCK_E,), kd.i32)
        for s0 in kd.range(0, numel, BLOCK_T):
            slot = s0 + lane
            ids = kd.load(expert_ids, slot // TOP_K, slot % TOP_K, other=-1)
            counts += kd.sum(kd.where(ids[None, :] == experts[:, None], 1, 0), axis=1)
        padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
        start += kd.sum(kd.where(experts < expert, padded, 0))
        count += kd.sum(kd.where(experts == expert, counts, 0))
        total += kd.sum(padded)

    # this expert's slots, in order: the rank of a slot is the number of this expert's slots before
    # it (those of earlier chunks, plus an exclusive prefix count inside the chunk)
    placed = kd.zeros((), kd.i32)
    for s0 in kd.range(0, numel, BLOCK_T):
        slot = s0 + lane
        ids = kd.load(expert_ids, slot // TOP_K, slot % TOP_K, other=-1)
        mine = ids == expert
        before = kd.sum(kd.where((lane[None, :] < lane[:, None]) & mine[None, :], 1, 0), axis=1)
        kd.store(sorted_ids, start + placed + before, slot, mask=mine)
        placed += kd.sum(kd.where(mine, 1, 0))

    # pad the run to whole blocks, and name this expert in each of its blocks
    padded_count = (count + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    pad = kd.arange(0, BLOCK_M)
    kd.store(sorted_ids, start + count + pad, numel, mask=pad < padded_count - count)
    n_blocks = padded_count // BLOCK_M
    for b0 in kd.range(0, n_blocks, BLOCK_T):
        kd.store(block_expert, start // BLOCK_M + b0 + lane, expert, mask=b0 + lane < n_blocks)
    kd.store(expert_offsets, expert, start)
    kd.store(expert_offsets, E, total, mask=expert == 0)

    # past the last run: sentinels and "no expert", the chunks shared out among the programs
    for p0 in kd.range(total + expert * BLOCK_T, sorted_ids.shape[0], E * BLOCK_T):
        kd.store(sorted_ids, p0 + lane, numel)
    for b0 in kd.range(total // BLOCK_M + expert * BLOCK_T, block_expert.shape[0], E * BLOCK_T):
        kd.store(block_expert, b0 + lane, -1)


def align(expert_ids: torch.Tensor, num_experts: int, block_m: int, **launch):
    """expert_ids (T, top_k) int -> (sorted_ids, block_expert, expert_offsets), see the module doc.
    Every id must lie in [0, num_experts): a slot with another id is in no block."""
    if expert_ids.dim() != 2 or expert_ids.numel() == 0:
        raise ValueError(f"align: expert_ids must be a non-empty (T, top_k) tensor, got {tuple(expert_ids.shape)}")
    if block_m & (block_m - 1) or block_m < 1:
        raise ValueError(f"align: block_m must be a power of two, got {block_m}")
    bufs = align_buffers(expert_ids, num_experts, block_m)
    moe_align(expert_ids, *bufs, **launch)
    return bufs
