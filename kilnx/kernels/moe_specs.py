"""What the MoE kernels mean (eager torch, float64) and how the tuner feeds them.

The formulas here are written independently of the kernels (the weight is unpacked with torch shifts,
per expert) and are themselves checked against MLX's gather_qmm in the tests.
"""

from __future__ import annotations

import torch

from kilnx.kernels.moe_align import (align_block_m, align_buffers, align_chunk, align_formula,
                                     chunk_counts_formula)

TORCH_ACTIVATIONS = {"silu": torch.nn.functional.silu,
                     "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}
# experts without a gate (kernels/moe.py UNGATED): the activation of the up projection alone
TORCH_UNGATED = {"relu2": lambda u: torch.nn.functional.relu(u).square()}


def dequantized_expert(wq, scales, biases, expert: int, bits: int, group: int) -> torch.Tensor:
    """W[expert] (N, K) in float64 on the weight's device: codes LSB-first in 32-bit words, w = scale * q + bias."""
    words = wq[expert].long() & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, device=wq.device)
    codes = ((words[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)
    s = scales[expert].double().repeat_interleave(group, dim=1)
    b = biases[expert].double().repeat_interleave(group, dim=1)
    return codes.double() * s + b


def gather_formula(x, wq, scales, biases, expert_ids, bits: int, group: int, x_by_token: bool) -> torch.Tensor:
    """(T * top_k, N) float64 on the CPU: slot i = t * top_k + k is x[t or i] @ W[expert_ids[t, k]]^T.
    Slots with expert -1 (never placed by the align step) stay zero. Computed where the weights are: the
    tuner's correctness gate runs this on every draw, and a 128-expert layer took ~9 s on two CPU cores."""
    top_k, dev = expert_ids.shape[1], wq.device
    ids = expert_ids.reshape(-1).long().to(dev)
    xd = x.detach().to(dev).double()
    rows = torch.arange(ids.numel(), device=dev) // top_k if x_by_token else torch.arange(ids.numel(), device=dev)
    out = torch.zeros(ids.numel(), wq.shape[1], dtype=torch.float64, device=dev)
    for e in ids.unique().tolist():
        if e < 0:
            continue
        sel = (ids == e).nonzero().flatten()
        out[sel] = xd[rows[sel]] @ dequantized_expert(wq, scales, biases, e, bits, group).T
    return out.cpu()


def slot_experts(sorted_ids, block_expert, num_slots: int, block_m: int) -> torch.Tensor:
    """The expert each slot was placed with by an align step (-1 where none), (num_slots,)."""
    pos = torch.arange(sorted_ids.shape[0])
    slot = sorted_ids.cpu().long()
    placed = slot < num_slots
    out = torch.full((num_slots,), -1, dtype=torch.long)
    out[slot[placed]] = block_expert.cpu().long()[pos[placed] // block_m]
    return out


def gather_spec(*args, gemm: bool, act, combine: bool, BITS, GROUP, X_BY_TOKEN, BLOCK_M=None, **_):
    """The spec of every gather kernel variant (see kilnx/kernels/moe.py for their arguments)."""
    if gemm:
        x, wq, scales, biases, sorted_ids, block_expert, routing = args
        T, top_k = routing.shape
        ids = slot_experts(sorted_ids, block_expert, T * top_k, BLOCK_M).reshape(T, top_k)
        weights = routing if routing.is_floating_point() else None
    else:
        x, wq, scales, biases, ids = args[:5]
        T, top_k = ids.shape
        weights = args[5] if len(args) > 5 else None
    y = gather_formula(x, wq, scales, biases, ids, BITS, GROUP, X_BY_TOKEN)
    if act in TORCH_UNGATED:
        y = TORCH_UNGATED[act](y)
    elif act:
        gate, up = y.chunk(2, dim=-1)
        y = TORCH_ACTIVATIONS[act](gate) * up
    if weights is not None:
        y = y * weights.detach().cpu().double().reshape(-1, 1)
    dtype = x.dtype
    if combine:
        y = y.reshape(T, top_k, -1).sum(1)
        dtype = torch.float32 if gemm else x.dtype   # the grouped GEMM adds into fp32 atomically
    return y.to(dtype).to(x.device)


def gather_tolerance(args, *, glu: bool):
    """(rtol, atol) for K-long dots of 16-bit-rounded operands: atol scales with sqrt(K) x rms(x) x
    the largest weight (cancelling sums); a GLU output is also multiplied by the up half (~ that)."""
    x, wq, scales, biases = args[:4]
    k = x.shape[1]
    bits = wq.shape[2] * 32 // k
    wmax = scales.float().abs().max().item() * (2 ** bits - 1) + biases.float().abs().max().item()
    scale = (k ** 0.5) * x.float().pow(2).mean().sqrt().item() * wmax
    atol = 4e-3 * scale
    return 2e-2, atol * (1 + 0.5 * scale) if glu else atol


# ---- tuning --------------------------------------------------------------------------------------
def moe_problems(E: int, top_k: int, hidden: int, width: int, *, bits: int = 4, gs: int = 64,
                 decode=(1, 4), prefill=(512, 2048), gpu: bool = True, gated: bool = True) -> list[tuple[str, dict]]:
    """(kernel name, problem) for one MoE layer's shapes: gate_up (+ activation) and down (+ combine),
    per-slot GEMVs at decode sizes (the packed-fp16 ones where `gpu`: what kilnx.ops.moe runs there),
    grouped GEMMs and the align step at prefill sizes. gated=False (relu² experts): up alone, then the
    down kernels with the combine, as kernels/moe.py's ungated path runs them."""
    base = {"top_k": top_k, "E": E, "bits": bits, "gs": gs}
    first = {**base, "N": 2 * width if gated else width, "K": hidden, "x": "token"}     # [gate | up], or up
    down = {**base, "N": hidden, "K": width, "x": "slot"}
    if gated:
        gemv, gemm = "gather_qmv_h2_glu" if gpu else "gather_qmv_glu", "gather_qmm_glu"
    else:
        gemv, gemm = "gather_qmv_h2_act" if gpu else "gather_qmv", "gather_qmm"
    combine = "gather_qmv_h2_combine" if gpu else "gather_qmv_combine"
    out = []
    for T in decode:
        out += [(gemv, {**first, "T": T}), (combine, {**down, "T": T})]
    if gated:
        out.append(("gather_qmv", {**first, "T": decode[0]}))
        if gpu:   # the one pass against the two GEMVs (kernels/moe_decode_route.py): two trials
            out.append(("moe_decode_path", {**first, "T": decode[0]}))
    for T in prefill:
        bm = align_block_m(T * top_k, E)
        out += [("moe_align_count", {"T": T, "top_k": top_k, "E": E}),
                ("moe_align_scatter", {"T": T, "top_k": top_k, "E": E, "BM": bm}),
                (gemm, {**first, "T": T, "BM": bm})]
        # the down GEMM with its combine: atomic adds on the GPU; elsewhere weighted slot rows, then their sum
        # (kernels/moe.py _down_combined)
        out += [("gather_qmm_combine", {**down, "T": T, "BM": bm})] if gpu else \
            [("gather_qmm", {**down, "T": T, "BM": bm}), ("moe_sum_slots", {"T": T, "top_k": top_k, "N": hidden})]
    if gated:
        out.append(("gather_qmm", {**first, "T": prefill[-1], "BM": align_block_m(prefill[-1] * top_k, E)}))
        if gpu:   # the one pass's own configs last: on the H200 the route above kept the two kernels
            out.append(("moe_onepass_h2", {**first, "T": decode[0]}))
    return out


QWEN3_30B_A3B = dict(E=128, top_k=8, hidden=2048, width=768)


def routed_experts(T: int, top_k: int, E: int) -> torch.Tensor:
    """(T, top_k) distinct experts per token from a skewed router (a few popular experts)."""
    logits = torch.randn(T, E) + torch.linspace(0, 2, E)[torch.randperm(E)]
    return torch.topk(logits, top_k, dim=1).indices


def random_expert_weights(E: int, N: int, K: int, bits: int, gs: int, dtype=torch.bfloat16):
    """Random packed words and small scales (a valid stack without quantizing on the host)."""
    wq = torch.randint(-2 ** 31, 2 ** 31 - 1, (E, N, K * bits // 32), dtype=torch.int32)
    scales = (torch.rand(E, N, K // gs) * 0.02 + 0.001).to(dtype)
    biases = (-scales.float() * 2 ** (bits - 1)).to(dtype)
    return wq, scales, biases


def make_args_for(gemm: bool, weighted: bool):
    """make_args(problem, device) for a gather kernel: {T, top_k, E, N, K, bits, gs, x, [BM]}."""
    def make(problem: dict, device: str):
        # the global generator: the tuner seeds it per draw, so gate inputs differ from timing inputs
        T, k, E, N, K = (problem[n] for n in ("T", "top_k", "E", "N", "K"))
        bits, gs = problem.get("bits", 4), problem.get("gs", 64)
        x = torch.randn(T if problem.get("x", "token") == "token" else T * k, K).to(torch.bfloat16)
        ids = routed_experts(T, k, E)
        rw = torch.softmax(torch.randn(T, k), dim=-1).to(torch.bfloat16)
        args = (x, *random_expert_weights(E, N, K, bits, gs))
        if gemm:
            sorted_ids, block_expert, _ = align_formula(ids, E, problem["BM"])
            args += (sorted_ids, block_expert, rw if weighted else ids)
        else:
            args += (ids, rw) if weighted else (ids,)
        return tuple(a.to(device) for a in args)
    return make


def make_align_args(scatter: bool):
    """{T, top_k, E, [BM]} -> (expert_ids, chunk counts) for moe_align_count (the counts empty), and
    for moe_align_scatter the counts filled plus the empty buffers it fills."""
    def make(problem: dict, device: str):
        ids = routed_experts(problem["T"], problem["top_k"], problem["E"])
        counts = chunk_counts_formula(ids, problem["E"], align_chunk(ids.numel()))
        if not scatter:
            return ids.to(device), torch.empty_like(counts).to(device)
        return (ids.to(device), counts.to(device), *align_buffers(ids.to(device), problem["E"], problem["BM"]))
    return make


# Where the tuner starts (besides the default). Decode: a program holds a token's top_k slots times
# BLOCK_N rows (top-8: 8 to 64 rows), and a tile is rows x BLOCK_KW words: about 1-2k words keeps
# the registers in check. Prefill: the usual tensor-core tiles.
# (BLOCK_N, BLOCK_KW, num_warps, STAGES): pipelined and plain chunk loops both (not yet measured for MoE)
GEMV_SEEDS = {
    "glu": [(1, 128, 4, 1), (2, 128, 4, 3), (1, 256, 4, 1), (2, 64, 4, 3), (4, 64, 4, 1), (4, 32, 2, 3),
            (8, 32, 4, 1)],
    "combine": [(1, 128, 4, 1), (2, 64, 4, 3), (4, 32, 4, 1), (1, 64, 2, 3), (2, 128, 4, 1), (8, 16, 4, 3)]}
GEMM_SEEDS = [(64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 3), (32, 64, 4, 4), (64, 64, 8, 4)]


def gemv_seeds(kind: str) -> list[dict]:
    return [{"BLOCK_N": bn, "BLOCK_KW": kw, "num_warps": nw, "STAGES": st, "MAGIC": True}
            for bn, kw, nw, st in GEMV_SEEDS[kind]]


def gemm_seeds() -> list[dict]:
    return [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns, "MAGIC": True}
            for bn, bk, nw, ns in GEMM_SEEDS]


def problems_by_kernel() -> dict[str, list[dict]]:
    """The qwen3-30b-a3b problems of every MoE kernel (the GPU's decode kernels and the CPU's)."""
    problems: dict[str, list[dict]] = {}
    for name, problem in (moe_problems(**QWEN3_30B_A3B) + moe_problems(**QWEN3_30B_A3B, gpu=False)
                          + moe_problems(**QWEN3_30B_A3B, gated=False)):     # the ungated decode kernel's too
        if problem not in problems.setdefault(name, []):
            problems[name].append(problem)
    return problems


def register_tuning():
    """Declare the tuner's inputs and the qwen3-30b-a3b problems on every MoE kernel."""
    from kilnx.kernels import moe
    from kilnx.kernels.moe_align import moe_align_count, moe_align_scatter
    problems = problems_by_kernel()
    for kernel, gemm, weighted, glu in [(moe.gather_qmm, True, False, False), (moe.gather_qmm_glu, True, False, True),
                                        (moe.gather_qmm_combine, True, True, False),
                                        (moe.gather_qmv, False, False, False), (moe.gather_qmv_glu, False, False, True),
                                        (moe.gather_qmv_combine, False, True, False)]:
        kernel.tuning(make_args=make_args_for(gemm, weighted), problems=problems[kernel.name])
        kernel.tolerance = (lambda g: lambda args: gather_tolerance(args, glu=g))(glu)
        seeds = gemm_seeds() if gemm else gemv_seeds("combine" if weighted else "glu")
        kernel.seed_configs = (lambda cs: lambda problem: [dict(c) for c in cs])(seeds)
    moe_align_count.tuning(make_args=make_align_args(False), problems=problems["moe_align_count"])
    moe_align_scatter.tuning(make_args=make_align_args(True), problems=problems["moe_align_scatter"])
