"""kernels/moe_combine.moe_sum_slots: a token's top_k slot rows summed (the CPU's MoE combine without atomics),
equal to the float64 sum over shapes and configs on every backend; and the CPU's grouped-GEMM MoE built on it
equals the one on the GPU's atomic combine kernel."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import moe as M
from kilnx.kernels.moe_align import align_formula
from kilnx.kernels.moe_combine import moe_sum_slots
from kilnx.quant import QWeight


@settings(max_examples=8, deadline=None, derandomize=True)
@given(T=st.integers(1, 9), top_k=st.sampled_from([1, 2, 6, 8]), N=st.sampled_from([1, 40, 128, 300]),
       cfg=st.sampled_from([None, {"BLOCK_N": 16}, {"BLOCK_N": 256, "num_warps": 1}]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_sum_slots_is_the_float64_sum(T, top_k, N, cfg, dtype):
    y = torch.randn(T * top_k, N, generator=torch.Generator().manual_seed(T * 31 + N)).to(dtype)
    want = y.double().reshape(T, top_k, N).sum(1)
    for backend in ("triton", "numba", "reference"):
        got = moe_sum_slots(y, TOP_K=top_k, backend=backend, config=cfg)
        assert got.dtype == torch.float32 and got.shape == (T, N)
        assert (got.double() - want).abs().max().item() <= 1e-5 * top_k * float(y.abs().max())


def test_the_cpu_combine_equals_the_atomic_one():
    """The down projection with its combine, as the CPU runs it (weighted slot rows, then their sum) and as the
    GPU does (gather_qmm_combine's atomic adds), on the same aligned slots: the same sums."""
    E, T, k, H, F = 5, 13, 3, 48, 64
    g = torch.Generator().manual_seed(7)
    dn = QWeight.quantize(torch.randn(E, H, F, generator=g), bits=4, group_size=32)
    h = torch.randn(T * k, F, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    rw = torch.rand(T, k, generator=g)
    sorted_ids, block_expert, _ = align_formula(ids, E, 16)
    args = (h, dn.packed, dn.scales, dn.biases, sorted_ids, block_expert, rw)
    atomic = M.gather_qmm_combine(*args)
    cpu = M._down_combined(h, (dn.packed, dn.scales, dn.biases), sorted_ids, block_expert, rw)
    assert (cpu - atomic).abs().max().item() <= 1e-5 * float(atomic.abs().max())
