"""On the GPU: the MoE kernels give the float64 formulas at realistic routing sizes (run with -m gpu)."""

from __future__ import annotations

import pytest
import torch

from kilnx.kernels import moe as M
from kilnx.kernels import moe_specs as S
from kilnx.kernels.moe_align import align, align_formula
from kilnx.quant import QWeight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

E, TOP_K, H, F = 16, 4, 512, 256


def stack(n, k, bits, seed):
    g = torch.Generator().manual_seed(seed)
    w = QWeight.quantize(torch.randn(E, n, k, generator=g) * 0.1, bits=bits, group_size=64)
    w = QWeight.from_mlx(w.packed, w.scales.bfloat16(), w.biases.bfloat16(), bits=bits, group_size=64)
    return QWeight.from_mlx(w.packed.cuda(), w.scales.cuda(), w.biases.cuda(), bits=bits, group_size=64)


def routing(T, seed):
    torch.manual_seed(seed)
    ids = S.routed_experts(T, TOP_K, E)
    return ids.cuda(), torch.softmax(torch.randn(T, TOP_K), -1).bfloat16().cuda()


def close(got, want, rel=2e-2):
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= rel * want.abs().max().item() + 1e-3, err


@pytest.mark.parametrize("T", [1, 64, 2048])
def test_align_on_gpu_equals_the_formula(T):
    ids, _ = routing(T, T)
    for bm in (16, 64, 128):
        for got, want in zip(align(ids, E, bm), align_formula(ids, E, bm)):
            assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("T", [1, 3, 17, 300])
def test_gather_qmatmul_on_gpu(bits, T):
    w = stack(2 * F, H, bits, seed=bits)
    ids, _ = routing(T, T)
    x = torch.randn(T, H).bfloat16().cuda()
    want = S.gather_formula(x, w.packed, w.scales, w.biases, ids, bits, 64, True)
    close(M.gather_qmatmul(x, w, ids).reshape(T * TOP_K, -1), want)


@pytest.mark.parametrize("cfg", [{"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
                                 {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}])
@pytest.mark.parametrize("T", [64, 2048])
def test_packed_bf16_grouped_gemms_on_gpu(cfg, T):
    """The prefill GEMMs with 4-bit codes decoded two per bf16x2 FMA (PACKED) give the formulas."""
    gu, dn = stack(2 * F, H, 4, seed=5), stack(H, F, 4, seed=6)
    ids, rw = routing(T, T + 1)
    x = torch.randn(T, H).bfloat16().cuda()
    sorted_ids, block_expert, _ = align(ids, E, 64)
    g, d = (gu.packed, gu.scales, gu.biases), (dn.packed, dn.scales, dn.biases)
    h = M.gather_qmm_glu(x, *g, sorted_ids, block_expert, ids, config={**cfg, "PACKED": True})
    close(h, S.gather_spec(x, *g, ids, gemm=False, act="silu", combine=False, BITS=4, GROUP=64,
                           X_BY_TOKEN=True).cpu().double())
    y = M.gather_qmm_combine(h, *d, sorted_ids, block_expert, rw, config={**cfg, "PACKED": True})
    close(y, S.gather_spec(h, *d, ids, rw, gemm=False, act=None, combine=True, BITS=4, GROUP=64,
                           X_BY_TOKEN=False).cpu().double())


def check_decode_pair(glu, combine, down_bits: int, seed: int, T: int):
    """glu(x, gate_up, ids) -> h and combine(h, down, ids, rw) -> y of one decode MoE against the formulas."""
    gu, dn = stack(2 * F, H, 4, seed=seed), stack(H, F, down_bits, seed=seed + 1)
    ids, rw = routing(T, seed + 3)
    x = torch.randn(T, H).bfloat16().cuda()
    g, d = (gu.packed, gu.scales, gu.biases), (dn.packed, dn.scales, dn.biases)
    h = glu(x, g, ids)
    close(h, S.gather_spec(x, *g, ids, gemm=False, act="silu", combine=False, BITS=4, GROUP=64,
                           X_BY_TOKEN=True).cpu().double())
    y = combine(h, d, ids, rw)
    close(y, S.gather_spec(h, *d, ids, rw, gemm=False, act=None, combine=True, BITS=down_bits, GROUP=64,
                           X_BY_TOKEN=False).cpu().double())


@pytest.mark.parametrize("cfg", [{"MAGIC": True}, {"MAGIC": False}, {"BLOCK_N": 16, "BLOCK_KW": 64, "num_warps": 2}])
@pytest.mark.parametrize("T", [1, 4])
def test_decode_kernels_on_gpu(cfg, T):
    check_decode_pair(lambda x, g, ids: M.gather_qmv_glu(x, *g, ids, config=cfg),
                      lambda h, d, ids, rw: M.gather_qmv_combine(h, *d, ids, rw, config=cfg), 4, 3, T)


@pytest.mark.parametrize("cfg", [None, {"BLOCK_N": 16, "BLOCK_KW": 64, "num_warps": 2, "STAGES": 3},
                                 {"BLOCK_N": 8, "BLOCK_KW": 128, "num_warps": 4, "STAGES": 1}])
@pytest.mark.parametrize("T", [1, 4])
def test_packed_fp16_decode_kernels_on_gpu(cfg, T):
    """kernels/moe_h2.py (what moe() runs on the GPU for 4/8-bit stacks), on prepared activations."""
    from kilnx.kernels import moe_h2 as MH
    from kilnx.kernels import qmv_h2 as QH
    check_decode_pair(
        lambda x, g, ids: MH.gather_qmv_h2_glu(*QH.qmv_h2_prep(x, PER=8, GROUP=64), *g, ids, config=cfg),
        lambda h, d, ids, rw: MH.gather_qmv_h2_combine(*QH.qmv_h2_prep(h, PER=4, GROUP=64), *d, ids, rw, config=cfg),
        8, 5, T)


def test_public_moe_on_gpu_every_path():
    gu, dn = stack(2 * F, H, 4, seed=7), stack(H, F, 8, seed=8)
    for T in (1, 4, 5, 2048):
        ids, rw = routing(T, T)
        x = torch.randn(T, H).bfloat16().cuda()
        h = S.gather_formula(x, gu.packed, gu.scales, gu.biases, ids, 4, 64, True)
        gate, up = h.chunk(2, -1)
        h = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
        y = S.gather_formula(h, dn.packed, dn.scales, dn.biases, ids, 8, 64, False)
        want = (y.reshape(T, TOP_K, H) * rw.cpu().double()[..., None]).sum(1)
        close(M.moe(x, gu, dn, ids, rw), want)



@pytest.mark.parametrize("cfg", [None, {"BLOCK_F": 16, "BLOCK_KW": 64, "BLOCK_H": 128, "num_warps": 4, "STAGES": 3},
                                 {"BLOCK_F": 64, "BLOCK_KW": 32, "BLOCK_H": 64, "num_warps": 8, "STAGES": 1}])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("down_t", [False, True])
def test_one_pass_decode_moe_on_gpu(cfg, T, down_t):
    """kernels/moe_onepass.py (what moe() runs on the GPU for 4/8-bit stacks at decode) against the float64
    formula: gate_up 4-bit, down 8-bit (MLX's layout or transposed), routed slots summed by atomic adds."""
    from kilnx.kernels import moe_onepass as MO
    from kilnx.kernels import qmv_h2 as QH
    gu, dn = stack(2 * F, H, 4, seed=3), stack(H, F, 8, seed=4)
    ids, rw = routing(T, 11 + T)
    x = torch.randn(T, H).bfloat16().cuda()
    g = S.gather_formula(x, gu.packed, gu.scales, gu.biases, ids, 4, 64, True)
    gate, up = g.chunk(2, -1)
    h = torch.nn.functional.silu(gate) * up * rw.cpu().double().reshape(-1, 1)
    want = S.gather_formula(h, dn.packed, dn.scales, dn.biases, ids, 8, 64, False).reshape(T, TOP_K, H).sum(1)
    got = MO.moe_onepass(*QH.qmv_h2_prep(x, PER=8, GROUP=64), gu, MO.down_transposed(dn) if down_t else dn, ids, rw,
                         config=cfg)
    assert got.dtype == torch.float32
    close(got, want, rel=2 ** -7)
