"""qmv_il (the CPU GEMV on row-interleaved weights) = MLX's quantized_matmul, through each backend, and
kilnx.ops.qmatmul takes it for CPU activations with few rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kilnx.kernels import qmv_cpu as C

pytest.importorskip("mlx.core")   # the reference (mlx_cases.py)
from mlx_cases import mlx_case  # noqa: E402


def check(got, want, k):
    tol = 1e-4 * (k ** 0.5) * float(want.abs().max()) + 1e-5   # fp32 sums in another order than MLX's
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert (got.double() - want.double()).abs().max().item() <= tol


@pytest.mark.parametrize("bits,gs,m,n", [(4, 32, 1, 48), (4, 64, 2, 40), (8, 32, 1, 17), (2, 128, 4, 7),
                                         (4, 32, 3, 130), (4, 32, 6, 40), (4, 32, 17, 40)])
def test_numba_matches_mlx(bits, gs, m, n, monkeypatch):
    """A program per row (1-4 rows); 8 rows per program part-filled (6 rows); 16 rows per program, the last
    block part-filled (17 rows)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, qw, want = mlx_case(m, n, 3 * gs, bits, gs, seed=bits * 100 + n)
    y = C.qmv_il(x, *C.interleave(qw.packed, qw.scales, qw.biases), backend="numba")
    assert y.shape == (m, -(-n // C.IL) * C.IL)
    check(y[:, :n], want, 3 * gs)
    assert (y[:, n:] == 0).all()   # padded rows: zero weights


def test_rows_per_program():
    assert [C.block_m(m) for m in (1, 4, 5, 8, 9, 16, 32)] == [1, 1, 8, 8, 16, 16, 16]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_other_backends_match_mlx(backend):
    x, qw, want = mlx_case(2, 20, 64, 4, 32, seed=5)
    y = C.qmv_il(x, *C.interleave(qw.packed, qw.scales, qw.biases), backend=backend)
    check(y[:, :20], want, 64)


@pytest.mark.parametrize("r", [1, 2, 8])
def test_block_ranges_past_the_end(r, monkeypatch):
    """R blocks per program that do not divide the blocks: the last program's extra blocks are skipped."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, qw, want = mlx_case(1, 3 * C.IL, 64, 4, 32, seed=r)
    y = C.qmv_il(x, *C.interleave(qw.packed, qw.scales, qw.biases), backend="numba", config={"R": r})
    check(y, want, 64)


def test_ops_qmatmul_takes_it_on_cpu(monkeypatch):
    import kilnx.ops as ops
    from kilnx.kernels import qmatmul as Q
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    Q._SERVED._store.clear()
    used = []
    real = C.run_qmv_il
    monkeypatch.setattr(C, "run_qmv_il", lambda *a, **k: used.append(a[0].shape[0]) or real(*a, **k))
    x, qw, want = mlx_case(1, 40, 128, 4, 64, seed=11)
    bf = x.to(torch.bfloat16)
    got = ops.qmatmul(bf.reshape(1, 1, 128), qw)
    ops.qmatmul(torch.zeros(5, 128, dtype=torch.bfloat16), qw)      # a short prompt's rows: the GEMV too
    ops.qmatmul(torch.zeros(33, 128, dtype=torch.bfloat16), qw)     # past 32 rows: the tile GEMM
    assert used == [1, 5]
    assert got.shape == (1, 1, 40) and got.dtype == torch.bfloat16
    want_bf = C._dense_spec(bf, qw.packed, qw.scales, qw.biases, 4, 64)
    assert torch.allclose(got[0].float(), want_bf.float(), rtol=2e-2, atol=1e-2 * float(want_bf.abs().max()))
    first = C._IL.get((qw.packed, qw.scales, qw.biases), None)
    ops.qmatmul(bf, qw)
    assert C._IL.get((qw.packed, qw.scales, qw.biases), None) is first     # repacked once per weight


def test_interleave_layout():
    wq = torch.arange(20 * 3, dtype=torch.int32).reshape(20, 3)
    s = torch.arange(20 * 2, dtype=torch.float32).reshape(20, 2)
    iw, isc, ib = C.interleave(wq, s, s)
    assert iw.shape == (2, 3, C.IL) and isc.shape == (2, 2, C.IL)
    assert iw[1, 2, 3] == wq[C.IL + 3, 2] and isc[0, 1, 5] == s[5, 1]
    assert (iw[1, :, 20 - C.IL:] == 0).all()
    np.testing.assert_array_equal(C._plain(iw, isc, ib)[0][:20].numpy(), wq.numpy())
