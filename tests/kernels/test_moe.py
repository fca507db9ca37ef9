"""kilnx/kernels/moe*.py: the align step, grouped GEMMs and per-slot GEMVs over expert stacks, moe().

MLX (`mlx[cpu]`) is the independent reference for the products: expert stacks are quantized by
`mx.quantize` and each kernel must give `mx.gather_qmm`'s result (x rows shared by a token's slots,
or one row per slot). Epilogues (GLU, routing weights, the sum over top_k) are checked against
numpy applied to MLX's products, and moe() against a float64 torch composition of dequantized
weights. The align step is checked by its invariants, and equals the torch formula exactly.
Kernels run on the Triton interpreter and the numpy reference interpreter with explicit small
configs (several column tiles, K tails, both int->float dequantizations); the numba backend on one
fixed case per kernel family.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import moe as M
from kilnx.kernels import moe_specs as S
from kilnx.kernels.moe_align import (align, align_buffers, align_capacity, align_formula, chunk_counts_formula,
                                     moe_align_count, moe_align_scatter)
from kilnx.quant import QWeight

mx = pytest.importorskip("mlx.core")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")

GEMM_CFG = {"BLOCK_N": 32, "BLOCK_K": 64}          # N = 40: two column tiles, K = 96: a tail; 64 and 128: none
GEMV_CFG = {"BLOCK_N": 16, "BLOCK_KW": 8}           # several chunks of whole groups
ACTS = {"silu": lambda g: g / (1 + np.exp(-g)),
        "gelu_tanh": lambda g: 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3)))}


def routing(T, k, E, seed, distinct=True, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    if distinct:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    else:   # a token may name an expert twice; nothing in the kernels may assume otherwise
        ids = torch.randint(0, E, (T, k), generator=g)
    weights = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    return ids.to(dtype), weights


def experts(E, N, K, bits, gs, seed):
    """(MLX arrays, QWeight) of one random expert stack."""
    w = np.random.default_rng(seed).standard_normal((E, N, K)).astype(np.float32)
    wq, s, b = mx.quantize(mx.array(w), group_size=gs, bits=bits)
    return (wq, s, b), QWeight.from_mlx(np.array(wq), np.array(s), np.array(b), bits=bits, group_size=gs)


def mlx_gather(x, mw, ids, bits, gs):
    """mx.gather_qmm per slot -> (T * top_k, N) float64; x has a row per token or per slot."""
    wq, s, b = mw
    T, k = ids.shape
    xs = mx.array(x.float().numpy())
    if x.shape[0] == T:
        y = mx.gather_qmm(xs[:, None, None, :], wq, s, b, rhs_indices=mx.array(ids.numpy().astype(np.int32)),
                          transpose=True, group_size=gs, bits=bits)
    else:
        y = mx.gather_qmm(xs[:, None, :], wq, s, b, rhs_indices=mx.array(ids.numpy().reshape(-1).astype(np.int32)),
                          transpose=True, group_size=gs, bits=bits)
    return torch.from_numpy(np.array(y)).reshape(T * k, -1).double()


def close(got, want, k, rel=1e-4):
    # fp32 accumulation in another order than MLX's: a few ulps of a K-long sum
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.isfinite(got).all()
    err = (got.double() - want).abs().max().item()
    assert err <= rel * (k ** 0.5) * float(want.abs().max()) + 1e-5, err


# ---- align --------------------------------------------------------------------------------------
def check_align(ids, E, bm, sorted_ids, block_expert, offsets):
    """The invariants the grouped GEMM relies on, checked directly (not against another implementation)."""
    flat = ids.reshape(-1).tolist()
    numel = len(flat)
    s, be, off = sorted_ids.tolist(), block_expert.tolist(), offsets.tolist()
    total = off[E]
    assert len(s) == align_capacity(numel, E, bm) == len(be) * bm and total <= len(s)
    assert sorted(i for i in s[:total] if i != numel) == list(range(numel))   # each slot exactly once
    assert all(i == numel for i in s[total:]) and all(b == -1 for b in be[total // bm:])
    for e in range(E):
        lo, hi = off[e], off[e + 1]
        mine = [i for i in range(numel) if flat[i] == e]
        assert lo % bm == 0 and hi - lo == -(-len(mine) // bm) * bm          # whole blocks, fewest
        assert s[lo:lo + len(mine)] == mine                                   # in slot order
        assert all(i == numel for i in s[lo + len(mine):hi])                  # then sentinels
        assert all(b == e for b in be[lo // bm:hi // bm])


@settings(max_examples=8, deadline=None, derandomize=True)
@given(T=st.sampled_from([1, 3, 17, 60]), k=st.sampled_from([1, 2, 3]), E=st.sampled_from([4, 6, 8, 20]),
       bm=st.sampled_from([16, 32]), distinct=st.booleans(), seed=st.integers(0, 999))
def test_align_groups_slots_by_expert_in_padded_blocks(T, k, E, bm, distinct, seed):
    ids, _ = routing(T, min(k, E), E, seed, distinct, dtype=torch.int32 if seed % 2 else torch.int64)
    want = align_formula(ids, E, bm)
    check_align(ids, E, bm, *want)
    # the public entry (chunks of 64 slots; on the Triton interpreter through moe() and gather_qmatmul)
    for got, w in zip(align(ids, E, bm, backend="reference"), want):
        assert torch.equal(got, w)
    for backend in ("triton", "reference"):
        # chunks of 16 slots: many chunks, several tiles of chunk counts (BLOCK_C = 16) and of experts
        counts = torch.empty(-(-ids.numel() // 16), E, dtype=torch.int32)
        moe_align_count(ids, counts, backend=backend, config={"BLOCK_E": 16})
        assert torch.equal(counts, chunk_counts_formula(ids, E, 16))
        bufs = align_buffers(ids, E, bm)
        moe_align_scatter(ids, counts, *bufs, backend=backend, config={"BLOCK_C": 16})
        for got, w in zip(bufs, want):
            assert torch.equal(got, w), backend


# ---- grouped GEMM and per-slot GEMV vs mx.gather_qmm ---------------------------------------------
@settings(max_examples=8, deadline=None, derandomize=True)
@given(bits=st.sampled_from([2, 4, 8]), gs=st.sampled_from([32, 64]), T=st.sampled_from([1, 3, 17]),
       E=st.sampled_from([4, 8]), N=st.sampled_from([7, 40, 64]), groups=st.sampled_from([1, 2, 3]),
       x_rows=st.sampled_from(["token", "slot"]), bm=st.sampled_from([16, 32]), magic=st.booleans(),
       stages=st.sampled_from([1, 3]))
def test_gather_kernels_match_mlx_gather_qmm(bits, gs, T, E, N, groups, x_rows, bm, magic, stages):
    K, k = gs * groups, 2
    mw, w = experts(E, N, K, bits, gs, seed=bits * 100 + T)
    ids, _ = routing(T, k, E, seed=T * 7 + E)
    x = torch.randn(T if x_rows == "token" else T * k, K, generator=torch.Generator().manual_seed(T))
    want = mlx_gather(x, mw, ids, bits, gs)
    sorted_ids, block_expert, _ = align_formula(ids, E, bm)
    for backend in ("triton", "reference"):
        got = M.gather_qmm(x, w.packed, w.scales, w.biases, sorted_ids, block_expert, ids, backend=backend,
                           config={**GEMM_CFG, "MAGIC": magic})
        close(got, want, K)
        if T <= 3:   # the decode kernel: one program per slot and column tile
            got = M.gather_qmv(x, w.packed, w.scales, w.biases, ids, backend=backend,
                               config={**GEMV_CFG, "MAGIC": magic, "STAGES": stages})
            close(got, want, K)


@settings(max_examples=3, deadline=None, derandomize=True)
@given(gs=st.sampled_from([32, 64, 128]), T=st.sampled_from([3, 17]), N=st.sampled_from([7, 40]),
       groups=st.sampled_from([1, 3]), act=st.sampled_from([None, "silu"]), block_k=st.sampled_from([32, 64]))
def test_packed_bf16_decode_in_the_grouped_gemm(gs, T, N, groups, act, block_k):
    """PACKED grouped GEMMs (4-bit codes two per bf16x2 instruction, kernels/bf16_decode.py) with bf16
    activations, scales and biases: each slot's product with its expert's weights rounded once to bf16,
    within the bf16 output's rounding, on every backend, plain and GLU."""
    E, k = 4, 2
    K = gs * groups
    _, w = experts(E, 2 * N, K, 4, gs, seed=T + N + gs)
    s, b = w.scales.bfloat16(), w.biases.bfloat16()
    codes = torch.stack([(w.packed.view(torch.int32).long() >> (4 * j)) & 15 for j in range(8)], -1)
    dense = (codes.reshape(E, 2 * N, groups, gs).double() * s.double()[..., None] + b.double()[..., None])
    dense = dense.reshape(E, 2 * N, K).bfloat16().double()
    ids, _ = routing(T, k, E, seed=T)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T)).bfloat16()
    prod = torch.einsum("tk,tjnk->tjn", x.double(), dense[ids]).reshape(T * k, 2 * N)
    want = torch.nn.functional.silu(prod[:, :N]) * prod[:, N:] if act else prod
    sorted_ids, block_expert, _ = align_formula(ids, E, 16)
    cfg = {"BLOCK_N": 32, "BLOCK_K": block_k, "PACKED": True}
    tol = 2 ** -7 * float(want.abs().max()) + 2 ** -8 * K ** 0.5 * float(x.abs().max()) * float(dense.abs().max())
    for backend in ("triton", "reference", "numba"):
        args = (x, w.packed, s, b, sorted_ids, block_expert, ids)
        got = (M.gather_qmm_glu(*args, backend=backend, config=cfg, ACT=act) if act
               else M.gather_qmm(*args, backend=backend, config=cfg))
        assert (got.double() - want).abs().max().item() <= (2 * tol if act else tol), backend


def test_public_gather_qmatmul_is_mlx_gather_qmm_squeezed():
    E, N, K, bits, gs = 6, 24, 128, 4, 64
    mw, w = experts(E, N, K, bits, gs, seed=1)
    for T in (1, 3, 17):   # decode GEMV below the crossover, align + grouped GEMM above
        ids, _ = routing(T, 2, E, seed=T)
        x = torch.randn(T, K)
        y = M.gather_qmatmul(x, w, ids)
        assert y.shape == (T, 2, N)
        close(y.reshape(T * 2, N), mlx_gather(x, mw, ids, bits, gs), K)
    # leading dims are kept
    y = M.gather_qmatmul(x.reshape(1, 17, K), w, ids.reshape(1, 17, 2))
    assert y.shape == (1, 17, 2, N)


# ---- epilogues ----------------------------------------------------------------------------------
def epilogue(products, ids, weights, act, combine):
    """numpy applied to MLX's per-slot products: GLU, routing weight, sum over top_k."""
    y = products.numpy()
    if act == "relu2":      # an ungated expert's activation of the product itself (nemotron-3)
        y = np.maximum(y, 0.0) ** 2
    elif act:
        gate, up = np.split(y, 2, axis=-1)
        y = ACTS[act](gate) * up
    if weights is not None:
        y = y * weights.double().numpy().reshape(-1, 1)
    if combine:
        y = y.reshape(ids.shape[0], ids.shape[1], -1).sum(1)
    return torch.from_numpy(y)


@pytest.mark.parametrize("act,weighted,combine,x_rows", [
    ("silu", False, False, "token"), ("gelu_tanh", True, False, "token"),
    (None, True, False, "slot"), (None, True, True, "slot"), (None, True, True, "token"),
    ("relu2", False, False, "token")])
def test_epilogues_match_numpy_on_mlx_products(act, weighted, combine, x_rows):
    E, T, k, K, bits, gs = 5, 17, 2, 96, 4, 32
    glu = act in ("silu", "gelu_tanh")
    N = 2 * 24 if glu else 40
    mw, w = experts(E, N, K, bits, gs, seed=3)
    ids, rw = routing(T, k, E, seed=5)
    x = torch.randn(T if x_rows == "token" else T * k, K, generator=torch.Generator().manual_seed(2))
    want = epilogue(mlx_gather(x, mw, ids, bits, gs), ids, rw if weighted else None, act, combine)
    wargs = (x, w.packed, w.scales, w.biases)
    sorted_ids, block_expert, _ = align_formula(ids, E, 16)
    gemm = M.gather_qmm_combine if combine else M.gather_qmm_glu if glu else M.gather_qmm
    extra = {"ACT": act} if act else {}
    for backend in ("triton", "reference"):
        got = gemm(*wargs, sorted_ids, block_expert, rw if weighted else ids, backend=backend, config=GEMM_CFG,
                   **extra)
        assert got.dtype == (torch.float32 if combine else x.dtype)
        close(got, want, K, rel=3e-4)
    if not weighted or combine:   # the decode kernels: GLU per slot, weighted sum over a token's slots
        Tq = 3
        want = epilogue(mlx_gather(x[: Tq if x_rows == "token" else Tq * k], mw, ids[:Tq], bits, gs), ids[:Tq],
                        rw[:Tq] if weighted else None, act, combine)
        xq = x[: Tq if x_rows == "token" else Tq * k]
        for backend in ("triton", "reference"):
            if combine:
                got = M.gather_qmv_combine(xq, *wargs[1:], ids[:Tq], rw[:Tq], backend=backend, config=GEMV_CFG)
            else:
                gemv = M.gather_qmv_glu if glu else M.gather_qmv
                got = gemv(xq, *wargs[1:], ids[:Tq], backend=backend, config=GEMV_CFG, ACT=act)
            close(got, want, K, rel=3e-4)


# ---- the whole MoE block ---------------------------------------------------------------------------
def moe_formula(x, gu, dn, ids, rw, act):
    """float64 torch composition over dequantized weights (the quant module's numpy reference)."""
    Wgu, Wd = gu.dequantize(torch.float32).double(), dn.dequantize(torch.float32).double()
    gate_up = torch.einsum("th,tknh->tkn", x.double(), Wgu[ids])
    gate, up = gate_up.chunk(2, dim=-1)
    h = torch.from_numpy(ACTS[act](gate.numpy())) * up
    return torch.einsum("tkf,tkhf,tk->th", h, Wd[ids], rw.double())


@pytest.mark.parametrize("T,dtype,act", [(1, torch.float32, "silu"), (3, torch.bfloat16, "gelu_tanh"),
                                         (17, torch.float32, "silu"), (17, torch.bfloat16, "silu")])
def test_moe_equals_the_composition(T, dtype, act):
    E, k, H, F = 6, 2, 64, 64
    _, gu = experts(E, 2 * F, H, 4, 32, seed=11)
    _, dn = experts(E, H, F, 8, 64, seed=12)
    ids, rw = routing(T, k, E, seed=T, distinct=T != 3)
    x = (torch.randn(T, H, generator=torch.Generator().manual_seed(T)) * 0.5).to(dtype)
    want = moe_formula(x, gu, dn, ids, rw, act)
    y = M.moe(x, gu, dn, ids, rw.to(dtype), activation=act)
    assert y.dtype == dtype and y.shape == (T, H)
    # bf16: the activations and the intermediate h are rounded to bf16 between the two products
    close(y, want, H + F, rel=1e-4 if dtype == torch.float32 else 4e-3)


def ungated_formula(x, up, dn, ids, rw):
    """nemotron-3's experts in float64: down_e(relu(up_e x)²), weighted and summed over the slots."""
    Wu, Wd = up.dequantize(torch.float32).double(), dn.dequantize(torch.float32).double()
    h = torch.relu(torch.einsum("th,tkfh->tkf", x.double(), Wu[ids])).square()
    return torch.einsum("tkf,tkhf,tk->th", h, Wd[ids], rw.double())


@pytest.mark.parametrize("T,dtype", [(1, torch.float32), (4, torch.bfloat16), (17, torch.float32)])
def test_ungated_relu2_experts_equal_their_composition(T, dtype):
    """activation="relu2": w_gate_up is the up projection alone; the decode path (per-slot GEMVs, up to
    MOE_DECODE_MAX_TOKENS tokens) and the grouped GEMMs (more) on the kernels, and the torch peer, all equal it."""
    from kilnx import ops_torch
    E, k, H, F = 6, 3, 64, 96
    _, up = experts(E, F, H, 4, 32, seed=13)
    _, dn = experts(E, H, F, 4, 32, seed=14)
    ids, rw = routing(T, k, E, seed=T + 1)
    x = (torch.randn(T, H, generator=torch.Generator().manual_seed(T)) * 0.5).to(dtype)
    want = ungated_formula(x, up, dn, ids, rw)
    for y in (M.moe(x, up, dn, ids, rw.to(dtype), activation="relu2"),
              ops_torch.moe(x, up, dn, ids, rw.to(dtype), activation="relu2")):
        assert y.dtype == dtype and y.shape == (T, H)
        close(y, want, H + F, rel=1e-4 if dtype == torch.float32 else 4e-3)
    with pytest.raises(ValueError, match="does not match"):      # a [gate | up] stack is twice as wide as down
        M.moe(x, up, experts(E, H, 2 * F, 4, 32, seed=15)[1], ids, rw, activation="relu2")


def test_torch_peer_ops_equal_the_composition():
    """kilnx.ops_torch's gather_qmatmul and moe (the eager peer models fall back to) mean the same."""
    from kilnx import ops_torch
    E, k, H, F, T = 6, 2, 64, 64, 9
    mw, gu = experts(E, 2 * F, H, 4, 32, seed=11)
    _, dn = experts(E, H, F, 8, 64, seed=12)
    ids, rw = routing(T, k, E, seed=4)
    x = torch.randn(T, H)
    close(ops_torch.gather_qmatmul(x, gu, ids).reshape(T * k, -1), mlx_gather(x, mw, ids, 4, 32), H)
    close(ops_torch.moe(x, gu, dn, ids, rw, activation="gelu_tanh"), moe_formula(x, gu, dn, ids, rw, "gelu_tanh"),
          H + F)


def test_moe_paths_agree_at_the_crossover():
    """The decode path and the align + grouped GEMM path compute the same thing."""
    E, k, H, F = 5, 3, 64, 32
    _, gu = experts(E, 2 * F, H, 4, 32, seed=1)
    _, dn = experts(E, H, F, 4, 32, seed=2)
    T = M.MOE_DECODE_MAX_TOKENS
    ids, rw = routing(T + 1, k, E, seed=9)
    x = torch.randn(T + 1, H)
    decode = M.moe(x[:T], gu, dn, ids[:T], rw[:T])
    grouped = M.moe(x, gu, dn, ids, rw)[:T]
    close(decode, grouped.double(), H + F)


def test_wrong_inputs_are_refused_with_a_clear_message():
    _, w = experts(4, 16, 64, 4, 32, seed=0)
    ids, rw = routing(2, 2, 4, seed=0)
    with pytest.raises(ValueError, match="does not match"):
        M.gather_qmatmul(torch.randn(2, 32), w, ids)
    with pytest.raises(ValueError, match="expert_ids"):
        M.gather_qmatmul(torch.randn(3, 64), w, ids)
    with pytest.raises(ValueError, match="expert stack"):
        M.gather_qmatmul(torch.randn(2, 64), QWeight.quantize(torch.randn(16, 64)), ids)
    w3 = QWeight.quantize(torch.randn(4, 16, 64), bits=3, group_size=32)
    with pytest.raises(NotImplementedError, match="2/4/8-bit"):
        M.gather_qmatmul(torch.randn(2, 64), w3, ids)
    with pytest.raises(ValueError, match="activation"):
        M.moe(torch.randn(2, 64), w, w, ids, rw, activation="relu")


# ---- numba ---------------------------------------------------------------------------------------
def test_numba_backend_on_one_case_per_kernel_family():
    # 8-bit: half the unrolled code positions of 4-bit, so a shorter cold numba compile
    E, T, k, H, F, bits, gs = 4, 5, 2, 64, 32, 8, 32
    mw, gu = experts(E, 2 * F, H, bits, gs, seed=21)
    ids, rw = routing(T, k, E, seed=22)
    x = torch.randn(T, H)
    bufs = align(ids, E, 16, backend="numba")
    for got, want in zip(bufs, align_formula(ids, E, 16)):
        assert torch.equal(got, want)
    products = mlx_gather(x, mw, ids, bits, gs)
    args = (x, gu.packed, gu.scales, gu.biases)
    close(M.gather_qmm(*args, bufs[0], bufs[1], ids, backend="numba", config=GEMM_CFG), products, H)
    glu = epilogue(products, ids, None, "silu", False)
    close(M.gather_qmv_glu(*args, ids, backend="numba", config=GEMV_CFG), glu, H, rel=3e-4)
