"""qmatmul = MLX's quantized_matmul, on every affine bit width and group size, through each backend.

MLX (`mlx[cpu]`) is the independent reference: weights are quantized by `mx.quantize`, wrapped with
`QWeight.from_mlx`, and kilnx's qmv / qmm must give `mx.quantized_matmul`'s result.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import qmatmul as Q
from kilnx.quant import QWeight

pytest.importorskip("mlx.core")   # the reference (mlx_cases.py)
from mlx_cases import mlx_case  # noqa: E402


def check(got, want, k):
    # fp32 accumulation in a different order than MLX's: a few ulps of the K-long sum
    tol = 1e-4 * (k ** 0.5) * float(want.abs().max()) + 1e-5
    assert got.shape == want.shape
    assert torch.isfinite(got).all()
    assert (got.double() - want.double()).abs().max().item() <= tol


@settings(max_examples=12, deadline=None, derandomize=True)
@given(bits=st.sampled_from([2, 3, 4, 5, 6, 8]), gs=st.sampled_from([32, 64, 128]),
       m=st.sampled_from([1, 2, 3, 8, 16, 17, 64]), n=st.sampled_from([1, 7, 40]),
       groups=st.sampled_from([1, 3]))
def test_qmatmul_matches_mlx_on_the_interpreter(bits, gs, m, n, groups):
    k = gs * groups
    x, qw, want = mlx_case(m, n, k, bits, gs, seed=bits * 1000 + m * 10 + n)
    kern = Q.run_qmv if (m <= 16 and 32 % bits == 0) else Q.qmm
    args = (x, qw.packed, qw.scales, qw.biases)
    check(kern(*args, backend="triton"), want, k)


@pytest.mark.parametrize("bits,gs,m", [(4, 64, 1), (8, 32, 3), (3, 128, 5), (6, 64, 17)])
def test_reference_interpreter_matches_mlx(bits, gs, m):
    x, qw, want = mlx_case(m, 24, 2 * gs, bits, gs, seed=7)
    for kern in (Q.run_qmv, Q.qmm) if 32 % bits == 0 and m <= 16 else (Q.qmm,):
        check(kern(x, qw.packed, qw.scales, qw.biases, backend="reference"), want, 2 * gs)


@pytest.mark.parametrize("kern,bits,m", [("run_qmv", 4, 1), ("qmm", 3, 5)])
def test_numba_matches_mlx(kern, bits, m):
    x, qw, want = mlx_case(m, 40, 128, bits, 64, seed=3)
    k = getattr(Q, kern)
    check(k(x, qw.packed, qw.scales, qw.biases, backend="numba"), want, 128)


@pytest.mark.parametrize("split_k,stages", [(2, 1), (4, 3)])
def test_split_k_adds_partial_sums(split_k, stages):
    """Also with a pipelined chunk loop, whose rows are unrolled (3 rows in a block of 4: one masked)."""
    x, qw, want = mlx_case(3, 16, 512, 4, 64, seed=11)
    y = Q.run_qmv(x, qw.packed, qw.scales, qw.biases, backend="triton",
                  config={"SPLIT_K": split_k, "BLOCK_KW": 8, "STAGES": stages})
    check(y.float(), want, 512)


@pytest.mark.parametrize("magic", [False, True])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qmv_dequantization_variants_agree(bits, magic):
    """The magic-number path (codes OR-ed into 2^23's mantissa) and the int->float path are the same
    numbers: each code is exact in fp32 either way."""
    x, qw, want = mlx_case(3, 12, 128, bits, 32, seed=bits)
    y = Q.run_qmv(x, qw.packed, qw.scales, qw.biases, backend="triton",
                  config={"MAGIC": magic, "BLOCK_KW": 32})
    check(y, want, 128)


@pytest.mark.parametrize("cfg", [{"SWAP": True, "MAGIC": True, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64},
                                 {"SWAP": False, "MAGIC": False, "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}])
@pytest.mark.parametrize("bits", [3, 4])
def test_qmm_swapped_and_magic_tiles(bits, cfg):
    x, qw, want = mlx_case(20, 40, 128, bits, 64, seed=bits + 1)
    check(Q.qmm(x, qw.packed, qw.scales, qw.biases, backend="triton", config=cfg), want, 128)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(m=st.sampled_from([1, 5, 17]), n=st.sampled_from([7, 40]), gs=st.sampled_from([32, 64, 128]),
       groups=st.sampled_from([1, 3]), block_k=st.sampled_from([32, 64, 128]), swap=st.booleans())
def test_packed_bf16_decode_gives_the_bf16_weights_product(m, n, gs, groups, block_k, swap):
    """PACKED qmm (4-bit codes decoded two at a time into bf16 pairs, kernels/bf16_decode.py) multiplies x
    by the weight q * s + b rounded once to bf16, with bf16 activations, scales and biases: within the
    output's bf16 rounding of x @ w.T over the exact bf16 weights, on every backend, for chunks smaller
    than, equal to and larger than a group."""
    k = gs * groups
    x, qw, _ = mlx_case(m, n, k, 4, gs, seed=m * 100 + n + gs)
    x, s, b = x.bfloat16(), qw.scales.bfloat16(), qw.biases.bfloat16()
    codes = torch.stack([(qw.packed.view(torch.int32).long() >> (4 * j)) & 15 for j in range(8)], -1).reshape(n, k)
    w = (codes.double().reshape(n, groups, gs) * s.double()[..., None] + b.double()[..., None]).reshape(n, k)
    want = x.double() @ w.bfloat16().double().T
    tol = 2 ** -7 * float(want.abs().max()) + 2 ** -8 * k ** 0.5 * float(x.abs().max()) * float(w.abs().max())
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": block_k, "SWAP": swap, "MAGIC": True, "PACKED": True,
           "num_warps": 4, "num_stages": 2}
    for backend in ["reference", "numba"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else []):
        got = Q.qmm(x, qw.packed, s, b, backend=backend, config=cfg)
        assert got.dtype == torch.bfloat16 and (got.double() - want).abs().max().item() <= tol, backend


@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 32), (2, 128)])
def test_dequant_then_dense_mm(bits, gs):
    x, qw, want = mlx_case(20, 24, 2 * gs, bits, gs, seed=bits + gs)
    w = Q.dequant(qw.packed, qw.scales, qw.biases, BITS=bits, GROUP=gs, backend="triton", config={"BLOCK_KW": 8})
    assert torch.equal(w, qw.dequantize(torch.float32))
    check(Q.dequant_mm(x, qw.packed, qw.scales, qw.biases), want, 2 * gs)


def test_qmv_prep_lays_out_planes_and_group_sums():
    x = torch.randn(3, 256)
    planes, sums = Q.qmv_prep(x, PER=8, GROUP=64, backend="triton", config={"BLOCK_KW": 16})
    assert torch.equal(planes[:, 5, 7], x[:, 7 * 8 + 5])
    assert torch.equal(Q._x_of(planes), x)
    assert torch.allclose(sums, x.reshape(3, 4, 64).sum(-1), atol=1e-5)


def test_public_op_dispatches_and_keeps_leading_dims():
    x, qw, want = mlx_case(6, 40, 128, 4, 64, seed=5)
    y = Q.qmatmul(x.reshape(2, 3, 128), qw)
    check(y.reshape(6, 40), want, 128)


def test_wrong_shapes_are_refused_with_a_clear_message():
    x, qw, _ = mlx_case(1, 8, 64, 4, 64, seed=1)
    with pytest.raises(ValueError, match="does not match"):
        Q.qmatmul(torch.randn(1, 32), qw)
    with pytest.raises(NotImplementedError, match="mxfp8"):
        Q.qmatmul(torch.randn(1, 64), QWeight.quantize(torch.randn(8, 64), mode="mxfp8"))
    with pytest.raises(ValueError, match="does not match"):
        Q.qmatmul(torch.randn(1, 32), QWeight.quantize(torch.randn(8, 64), mode="mxfp4"))


@pytest.mark.parametrize("m,n,k", [(1, 33, 70), (20, 17, 48)])
def test_dense_mm_for_unquantized_weights(m, n, k):
    x, w = torch.randn(m, k), torch.randn(n, k)
    y = Q.qmatmul(x, w)
    assert (y.double() - x.double() @ w.double().T).abs().max().item() < 1e-3 * k ** 0.5


@settings(max_examples=6, deadline=None, derandomize=True)
@given(m=st.integers(1, 70), n=st.integers(1, 80), k=st.sampled_from([16, 48, 96]), tma=st.booleans())
def test_persistent_dense_mm_gives_the_tiled_grids_bits(m, n, k, tma):
    """One program per SM (4 off the GPU) walking the output tiles computes every tile once, as the
    2-d grid does: the same tiles over the same K order, so the same bits, for any tile count against
    the program count (fewer tiles than programs, several rounds, a ragged last round), on every backend."""
    backends = ["reference", "numba"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2, "TMA": tma}
    for backend in backends:
        tiled = Q.mm(x, w, backend=backend, config={**cfg, "PERSISTENT": False})
        assert torch.equal(Q.mm(x, w, backend=backend, config={**cfg, "PERSISTENT": True}), tiled), backend
    assert (tiled.double() - x.double() @ w.double().T).abs().max().item() <= 2 ** -7 * (x.double() @ w.double().T).abs().max().item() + 1e-6


@pytest.mark.parametrize("bits,gs", [(2, 32), (4, 64), (8, 128)])
def test_device_dequantization_equals_the_numpy_reference(bits, gs):
    """The tuner's gate and the benchmarks' cuBLAS peer dequantize with torch on the device."""
    _, qw, _ = mlx_case(1, 24, 2 * gs, bits, gs, seed=bits)
    got = Q.dequantize_on_device(qw.packed, qw.scales, qw.biases, bits, gs)
    assert torch.equal(got, qw.dequantize(torch.float32))
