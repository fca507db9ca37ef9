"""On the GPU: every dequantization path of qmv and qmm gives the dense result (run with -m gpu)."""

from __future__ import annotations

import pytest
import torch

from kilnx.kernels import dense_mm
from kilnx.kernels import qmatmul as Q
from kilnx.kernels import routing as R
from kilnx.quant import QWeight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def case(m, n, k, bits, gs=64):
    g = torch.Generator().manual_seed(m * 100 + bits)
    w = QWeight.quantize(torch.randn(n, k, generator=g), bits=bits, group_size=gs)
    w = QWeight.from_mlx(w.packed, w.scales.bfloat16(), w.biases.bfloat16(), bits=bits, group_size=gs)
    x = torch.randn(m, k, generator=g).bfloat16()
    want = x.double() @ w.dequantize(torch.float32).double().T
    return x.cuda(), w.packed.cuda(), w.scales.cuda(), w.biases.cuda(), want


def close(got, want, k):
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item() + 1e-3, err


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("cfg", [{"MAGIC": True}, {"MAGIC": False},
                                 {"MAGIC": True, "SPLIT_K": 4, "BLOCK_KW": 64, "BLOCK_N": 8}])
def test_qmv_on_gpu(bits, m, cfg):
    x, wq, s, b, want = case(m, 200, 1024, bits)
    close(Q.run_qmv(x, wq, s, b, config=cfg), want, 1024)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("cfg", [{}, {"SPLIT_K": 4, "BLOCK_KW": 64, "BLOCK_N": 8}, {"BLOCK_N": 4, "BLOCK_KW": 512}])
def test_qmv_h2_on_gpu(bits, m, cfg):
    from kilnx.kernels import qmv_h2 as H
    x, wq, s, b, want = case(m, 200, 1024, bits)
    close(H.run_qmv_h2(x, wq, s, b, config=cfg), want, 1024)
    big = x * 3e4                                   # beyond fp16's range: the per-group scaling holds it
    close(H.run_qmv_h2(big, wq, s, b, config=cfg), want * 3e4, 1024)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 16, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [{}, {"SWAP": False, "BLOCK_N": 32, "SPLIT_K": 2}, {"BLOCK_N": 128, "STAGES": 6}])
def test_qmv_tc_on_gpu(bits, m, dtype, cfg):
    from kilnx.kernels import qmv_tc as T
    x, wq, s, b, want = case(m, 200, 1024, bits)
    got = T.run_qmv_tc(x.to(dtype), wq, s.to(dtype), b.to(dtype), config=cfg)
    assert got.dtype == dtype
    close(got, want, 1024)


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("m", [5, 130])
@pytest.mark.parametrize("cfg", [{"MAGIC": True, "SWAP": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128},
                                 {"MAGIC": True, "SWAP": False},
                                 {"MAGIC": False, "SWAP": False, "BLOCK_M": 64, "BLOCK_N": 64},
                                 {"PACKED": True, "SWAP": False, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64,
                                  "num_warps": 8, "num_stages": 3},
                                 {"PACKED": True, "SWAP": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}])
def test_qmm_on_gpu(bits, m, cfg):
    """PACKED (two 4-bit codes per bf16x2 instruction) applies to the 4-bit cases, the others ignore it."""
    x, wq, s, b, want = case(m, 200, 1024, bits)
    close(Q.qmm(x, wq, s, b, config=cfg), want, 1024)


def test_public_qmatmul_on_gpu_every_m():
    # every route and default: GEMVs, the fused qmm on its fp32 and (above 16 rows, 4-bit bf16) packed
    # decode defaults (64-wide tiles on a starved grid up to NARROW_TILE_MAX_ROWS), the two-kernel path from
    # 320 rows or above those where 128-wide fused tiles would starve the grid (16896 weight rows: 132 tiles of 128 at
    # least, so that on up to 132 SMs the fused kernel is not routed away for a starved grid)
    for m, n in [(1, 96), (2, 96), (9, 96), (16, 96), (17, 96), (40, 16896), (64, 16896), (65, 16896), (65, 96),
                 (R.NARROW_TILE_MAX_ROWS, 96), (R.NARROW_TILE_MAX_ROWS + 1, 96), (300, 16896), (400, 96)]:
        x, wq, s, b, want = case(m, n, 512, 4)
        w = QWeight.from_mlx(wq, s, b, bits=4, group_size=64)
        assert R.takes_dequant_mm(x, wq, s, b) is (m >= 320 or (m > R.NARROW_TILE_MAX_ROWS and n == 96))
        close(Q.qmatmul(x, w), want, 512)


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("m", [1, 3, 40])
def test_fp4_qmatmul_on_gpu(mode, m):
    from kilnx.kernels import qmatmul_fp4 as F
    x, wq, scales, gscale = F.make_fp4_args({"M": m, "N": 200, "K": 1024, "mode": mode}, "cuda")
    want = x.double().cpu() @ F.dense_weight(wq, scales, gscale).double().cpu().T
    got = F.run_fp4_qmv(x, wq, scales, gscale) if m <= F.FP4_QMV_MAX_ROWS else F.fp4_qmm(x, wq, scales, gscale)
    close(got, want, 1024)
    if m <= F.FP4_QMV_MAX_ROWS:   # the GPU's fp4 GEMV: two codes per fp16 instruction
        from kilnx.kernels.fp4_qmv_h2 import run_fp4_qmv_h2
        close(run_fp4_qmv_h2(x, wq, scales, gscale), want, 1024)


def test_every_e4m3_scale_code_decodes_exactly_on_the_gpu():
    """nvfp4's scale decode reads the code's bits as an fp32 subnormal for the e4m3 subnormals and
    multiplies by 2^120: exact only if the GPU's multiply keeps subnormal inputs (no flush to zero)."""
    import numpy as np

    import kilnx.dsl as kd
    from kilnx.kernels import qmatmul_fp4 as F
    from kilnx.quant.float_codecs import E4M3_VALUES

    @kd.kernel
    def decode_scales(scale_codes):
        kd.grid(1)
        c = kd.arange(0, 256)
        out = kd.output((256,), kd.f32)
        kd.store(out, c, F._group_scales(kd.load(scale_codes, c), True))
        return out

    got = decode_scales(torch.arange(256, dtype=torch.int32).to(torch.uint8).cuda()).cpu().numpy()
    np.testing.assert_array_equal(got, E4M3_VALUES)


@pytest.mark.parametrize("m,n,k", [(1, 256, 128), (200, 384, 256), (513, 1024, 4096), (4096, 2048, 512)])
@pytest.mark.parametrize("tma", [True, False])
def test_persistent_dense_mm_gives_the_tiled_grids_bits_on_gpu(m, n, k, tma):
    """One program per SM, tile and K loops flattened (Triton pipelines across the tiles' ends): the same
    bits as a program per tile, with fewer tiles than SMs and with many rounds of them."""
    g = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=g).bfloat16().cuda(), torch.randn(n, k, generator=g).bfloat16().cuda()
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4, "TMA": tma}
    tiled = Q.mm(x, w, config={**cfg, "PERSISTENT": False})
    assert torch.equal(Q.mm(x, w, config={**cfg, "PERSISTENT": True}), tiled)
    close(tiled, (x.double() @ w.double().T).cpu(), k)


@pytest.mark.parametrize("m,n,k", [(1, 256, 128), (200, 384, 256), (513, 1024, 4096)])
@pytest.mark.parametrize("tma", [True, False])
def test_dense_mm_with_and_without_tma_boxes_on_gpu(m, n, k, tma):
    """The dense GEMM reading its operands as kd.load_tile boxes (TMA) or pointer tiles; an x whose rows
    are not 16-byte aligned takes the pointer path whatever the config says."""
    g = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=g).bfloat16().cuda(), torch.randn(n, k, generator=g).bfloat16().cuda()
    cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, "TMA": tma}
    want = x.double() @ w.double().T
    close(Q.mm(x, w, config=cfg), want.cpu(), k)
    ragged = torch.randn(m, k + 1, generator=g).bfloat16().cuda()[:, :k]     # rows 2k + 2 bytes apart
    ragged.copy_(x)
    assert not dense_mm.tma_ready(ragged, w)
    close(Q.mm(ragged, w, config=cfg), want.cpu(), k)
