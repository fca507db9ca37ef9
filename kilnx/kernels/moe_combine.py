"""The sum of a token's top_k slot outputs: the MoE combine without atomics, for the CPU backends.

Why: the grouped GEMM's combine (`gather_qmm_combine`) adds each slot's weighted product into its token's row by
atomic adds, which the numba backend runs as plain read-modify-writes on one thread, in program order
(codegen/numba_launch.py). On two CPU cores that serial down projection took 17 ms of a 128-token MoE layer against
13 ms for the parallel up projection of the same size (nemotron-3's MoE stack in bench/probes/hybrid_cpu_vs_hf.py,
cProfile, session 30). There the down GEMM writes each slot's weighted row (`gather_qmm` with the routing
weights), in parallel, and this kernel sums a token's rows: a (T * top_k, N) fp32 pass more, a few MB.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd
from kilnx.kernels.sizes import pow2_at_least


def _sum_spec(y, *, TOP_K, **_):
    return y.double().reshape(-1, TOP_K, y.shape[1]).sum(1).float()


@kd.kernel(tune={"BLOCK_N": kd.pow2(16, 2048, default=512), "num_warps": kd.choice(1, 2, 4, default=4)},
           key=lambda y, **kw: {"M": y.shape[0], "N": y.shape[1], "top_k": kw["TOP_K"]}, spec=_sum_spec,
           default=lambda y, **_: {"BLOCK_N": min(2048, max(16, pow2_at_least(y.shape[1])))})
def moe_sum_slots(y, *, TOP_K: kd.constexpr, BLOCK_N):
    """y (T * TOP_K, N), slot t * TOP_K + k of token t -> (T, N) fp32: sum_k y[t * TOP_K + k]."""
    numel, N = y.shape
    t, nb = kd.grid(numel // TOP_K, kd.cdiv(N, BLOCK_N))
    n = nb * BLOCK_N + kd.arange(0, BLOCK_N)
    acc = kd.zeros((BLOCK_N,), kd.f32)
    for k in kd.static_range(TOP_K):
        acc += kd.load(y, t * TOP_K + k, n).f32()
    out = kd.output((numel // TOP_K, N), kd.f32)
    kd.store(out, t, n, acc)
    return out


def make_sum_args(problem: dict, device: str):
    return (torch.randn(problem["T"] * problem["top_k"], problem["N"]).to(device),)


moe_sum_slots.tuning(make_args=make_sum_args, problems=[{"T": 128, "top_k": 8, "N": 2048}])
