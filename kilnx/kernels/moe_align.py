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
and E = len(expert_offsets) - 1 follow from the buffers' shapes: the kernels need no other argument.

Two launches, no atomics (the result is deterministic), O(numel x E) work in all:
  moe_align_count    one program per chunk of CHUNK slots: its histogram over experts, into
                     chunk_counts (chunks, E).
  moe_align_scatter  one program per chunk, then one per expert. Each sums chunk_counts into every
                     expert's total and this chunk's prefix, hence every expert's start; a chunk
                     program places its slots at start + (earlier chunks' count) + (rank inside the
                     chunk, an exclusive prefix count); an expert program writes its padding, its
                     blocks' expert, its offset, and a share of the tail past the last run.
(H200, qwen3-30b-a3b prefill: a one-kernel version with a program per expert scanning every slot
took 580 us of a 1730 us MoE layer.)
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd
from kilnx.kernels.rope import InPlaceAsOutputs
from kilnx.kernels.sizes import pow2_at_least

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
    """Uninitialised (sorted_ids, block_expert, expert_offsets) for `moe_align_scatter` to fill."""
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


def align_chunk(num_slots: int) -> int:
    """Slots per chunk: the scatter ranks a chunk with a CHUNK x CHUNK comparison (registers), and
    every program of it reads all chunk counts (chunks x E): small chunks for small routings."""
    return 64 if num_slots <= 16384 else 128


def _chunk_of(expert_ids, chunk_counts) -> int:
    """The chunk size the host chose, from the buffer's shape: the power of two >= numel / chunks
    (CHUNK / 2 < numel / chunks <= CHUNK whenever there are several chunks; one chunk of any size
    >= numel serves alike)."""
    per = -(-expert_ids.numel() // chunk_counts.shape[0])
    return 1 << max(per - 1, 0).bit_length()


def chunk_counts_formula(expert_ids, num_experts: int, chunk: int) -> torch.Tensor:
    flat = expert_ids.reshape(-1).long().cpu()
    chunks = -(-flat.numel() // chunk)
    which = torch.arange(flat.numel()) // chunk
    counts = torch.zeros(chunks, num_experts, dtype=torch.int32)
    valid = (flat >= 0) & (flat < num_experts)
    counts.index_put_((which[valid], flat[valid]), torch.ones(int(valid.sum()), dtype=torch.int32), accumulate=True)
    return counts.to(expert_ids.device)


def _count_spec(expert_ids, chunk_counts, *, CHUNK, **_):
    return (chunk_counts_formula(expert_ids, chunk_counts.shape[1], CHUNK),)


def _scatter_spec(expert_ids, chunk_counts, sorted_ids, block_expert, expert_offsets, *, BLOCK_M, **_):
    return align_formula(expert_ids, expert_offsets.shape[0] - 1, BLOCK_M)


def _align_key(expert_ids, chunk_counts, *rest, BLOCK_M=None, **_):
    k = {"T": expert_ids.shape[0], "top_k": expert_ids.shape[1], "E": chunk_counts.shape[1]}
    return k if BLOCK_M is None else {**k, "BM": BLOCK_M}


@InPlaceAsOutputs.of(mutated=(1,))
@kd.kernel(tune={"BLOCK_E": kd.pow2(16, 256, default=64), "num_warps": kd.choice(1, 2, 4, 8, default=4)},
           key=_align_key, spec=_count_spec,
           specialize=lambda ids, counts: {"CHUNK": _chunk_of(ids, counts)})
def moe_align_count(expert_ids, chunk_counts, *, CHUNK: kd.constexpr, BLOCK_E):
    T, TOP_K = expert_ids.shape
    E = chunk_counts.shape[1]
    chunk = kd.grid(chunk_counts.shape[0])
    slot = chunk * CHUNK + kd.arange(0, CHUNK)
    ids = kd.load(expert_ids, slot // TOP_K, slot % TOP_K, other=-1)
    for e0 in kd.range(0, E, BLOCK_E):
        experts = e0 + kd.arange(0, BLOCK_E)
        kd.store(chunk_counts, chunk, experts, kd.sum(kd.where(ids[None, :] == experts[:, None], 1, 0), axis=1))


@InPlaceAsOutputs.of(mutated=(2, 3, 4))
@kd.kernel(tune={"BLOCK_C": kd.pow2(16, 256, default=32), "num_warps": kd.choice(1, 2, 4, 8, default=4)},
           key=_align_key, spec=_scatter_spec,
           specialize=lambda ids, counts, sorted_ids, block_expert, offsets: {
               "CHUNK": _chunk_of(ids, counts), "BLOCK_M": sorted_ids.shape[0] // block_expert.shape[0],
               "BLOCK_E": pow2_at_least(counts.shape[1])})
def moe_align_scatter(expert_ids, chunk_counts, sorted_ids, block_expert, expert_offsets, *, CHUNK: kd.constexpr,
                      BLOCK_M: kd.constexpr, BLOCK_E: kd.constexpr, BLOCK_C):
    T, TOP_K = expert_ids.shape
    numel = T * TOP_K
    NC, E = chunk_counts.shape
    pid = kd.grid(NC + E)                   # chunk programs, then expert programs
    ex = kd.arange(0, BLOCK_E)

    # every expert's total, and its count in the chunks before this one
    total = kd.zeros((BLOCK_E,), kd.i32)
    before = kd.zeros((BLOCK_E,), kd.i32)
    for c0 in kd.range(0, NC, BLOCK_C):
        chunks = c0 + kd.arange(0, BLOCK_C)
        counts = kd.load(chunk_counts, chunks[:, None], ex[None, :])
        total += kd.sum(counts, axis=0)
        before += kd.sum(kd.where(chunks[:, None] < pid, counts, 0), axis=0)
    padded = (total + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    start = kd.sum(kd.where(ex[None, :] < ex[:, None], padded[None, :], 0), axis=1)   # exclusive prefix
    grand = kd.sum(padded)

    # a chunk program places its slots (an expert program's "chunk" lies past the end: all masked)
    lane = kd.arange(0, CHUNK)
    slot = pid * CHUNK + lane
    ids = kd.load(expert_ids, slot // TOP_K, slot % TOP_K, other=-1)
    rank = kd.sum(kd.where((ids[None, :] == ids[:, None]) & (lane[None, :] < lane[:, None]), 1, 0), axis=1)
    base = kd.sum(kd.where(ids[:, None] == ex[None, :], (start + before)[None, :], 0), axis=1)
    kd.store(sorted_ids, base + rank, slot, mask=(ids >= 0) & (ids < E))

    # an expert program (e >= 0) pads its run, names itself in its blocks and records its offset; in a
    # chunk program (e < 0) `mine` is empty, so it has nothing to pad and no blocks
    e = pid - NC
    mine = ex == e
    e_start = kd.sum(kd.where(mine, start, 0))
    e_count = kd.sum(kd.where(mine, total, 0))
    e_padded = kd.sum(kd.where(mine, padded, 0))
    pad = kd.arange(0, BLOCK_M)
    kd.store(sorted_ids, e_start + e_count + pad, numel, mask=pad < e_padded - e_count)
    n_blocks = e_padded // BLOCK_M
    lane_c = kd.arange(0, BLOCK_C)
    for b0 in kd.range(0, n_blocks, BLOCK_C):
        kd.store(block_expert, e_start // BLOCK_M + b0 + lane_c, e, mask=b0 + lane_c < n_blocks)
    kd.store(expert_offsets, e, e_start, mask=e >= 0)
    kd.store(expert_offsets, E, grand, mask=e == 0)

    # past the last run: sentinels and "no expert", shared out among the expert programs (chunk
    # programs start their loops at the end: no trips)
    cap, n_all = sorted_ids.shape[0], block_expert.shape[0]
    for p0 in kd.range(kd.where(e >= 0, grand + e * CHUNK, cap), cap, E * CHUNK):
        kd.store(sorted_ids, p0 + lane, numel)
    for b0 in kd.range(kd.where(e >= 0, grand // BLOCK_M + e * BLOCK_C, n_all), n_all, E * BLOCK_C):
        kd.store(block_expert, b0 + lane_c, -1)


def align(expert_ids: torch.Tensor, num_experts: int, block_m: int, *, backend: str | None = None,
          configs: tuple = (None, None)):
    """expert_ids (T, top_k) int -> (sorted_ids, block_expert, expert_offsets), see the module doc.
    Every id must lie in [0, num_experts): a slot with another id is in no block. `configs`: those of
    moe_align_count and moe_align_scatter (default: tuned, else their defaults)."""
    if expert_ids.dim() != 2 or expert_ids.numel() == 0:
        raise ValueError(f"align: expert_ids must be a non-empty (T, top_k) tensor, got {tuple(expert_ids.shape)}")
    if block_m & (block_m - 1) or block_m < 1:
        raise ValueError(f"align: block_m must be a power of two, got {block_m}")
    bufs = align_buffers(expert_ids, num_experts, block_m)
    chunks = -(-expert_ids.numel() // align_chunk(expert_ids.numel()))
    counts = torch.empty(chunks, num_experts, dtype=torch.int32, device=expert_ids.device)
    moe_align_count(expert_ids, counts, backend=backend, config=configs[0])
    moe_align_scatter(expert_ids, counts, *bufs, backend=backend, config=configs[1])
    return bufs
