"""kernels/swiglu_prep.qmv_h2_swiglu_prep: gate_up's GEMV, the SwiGLU and down's prep in one launch, equal bit for
bit to the two launches it replaces (qmv_h2 on [gate | up], then silu_mul_prep) with the same tile, over one and
two quantization groups of h a program; against the float formula; tiles that split a group are refused (a llama
forward through it: tests/kernels/test_prepared.py)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import prepared
from kilnx.kernels import qmv_h2 as H
from kilnx.kernels import swiglu_prep as S
from kilnx.kernels.qmatmul import make_qmatmul_args

CPU_ONLY = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                              reason="the CPU tests run Triton kernels under TRITON_INTERPRET=1")


def case(m, f, k, bits, seed=0):
    """Prepared x (m, k) and a random [gate | up] weight (2f, k), MLX affine gs64."""
    torch.manual_seed(seed)
    x, wq, scales, biases = make_qmatmul_args({"M": m, "N": 2 * f, "K": k, "bits": bits, "gs": 64}, "cpu")
    return (*H._prep_spec(x.float(), PER=32 // bits, GROUP=64), wq, scales, biases)


@CPU_ONLY
@settings(max_examples=6, deadline=None, derandomize=True)
@given(m=st.sampled_from([1, 3]), f=st.sampled_from([64]), bits=st.sampled_from([4, 8]),
       out=st.sampled_from([(8, 64), (4, 64), (8, 32)]), groups=st.sampled_from([1, 2]),
       tile=st.sampled_from([{"BLOCK_KW": 8, "STAGES": 1, "CHAIN": 1}, {"BLOCK_KW": 16, "STAGES": 3, "CHAIN": 2}]))
def test_one_launch_equals_the_gemv_then_silu_mul_prep(m, f, bits, out, groups, tile):
    """One or two groups of h a program (two where the group is 32)."""
    per, group = out
    block_n = min(2 * group * groups, 2 * f)
    args = case(m, f, 128, bits, seed=m + f + bits)
    cfg = {"BLOCK_N": block_n, "num_warps": 2, **tile}
    h, planes, sums, xs = S.qmv_h2_swiglu_prep(*args, PER_OUT=per, GROUP_OUT=group, backend="triton", config=cfg)
    # a row's sums do not depend on how many rows a program holds (qmv_h2 holds at most 64)
    gate_up = H.qmv_h2(*args, backend="triton", config={**cfg, "BLOCK_N": min(block_n, 64), "SPLIT_K": 1})
    want = prepared.silu_mul_prep(gate_up, PER=per, GROUP=group, backend="triton", config={"BLOCK_KW": 16})
    assert h.shape == (m, f) and h.dtype == gate_up.dtype
    for got, ref in zip((planes, sums, xs), want):
        assert torch.equal(got, ref)


@CPU_ONLY
@pytest.mark.parametrize("backend", ["triton", "numba"])
def test_against_the_float_formula(backend):
    args = case(2, 128, 256, 4, seed=5)
    got = S.qmv_h2_swiglu_prep(*args, PER_OUT=8, GROUP_OUT=64, backend=backend,
                               config={"BLOCK_N": 128, "BLOCK_KW": 16, "STAGES": 1})
    want = S.qmv_h2_swiglu_prep.reference(*args, PER_OUT=8, GROUP_OUT=64)
    # fp16 products and three bf16 roundings (the interpreter truncates them: a few ulps)
    tol = 2 ** -5 * want[0].float().abs().max().item()
    assert (got[0].float() - want[0].float()).abs().max().item() <= tol
    assert (H._x_of(got[1], got[3]) - H._x_of(want[1], want[3])).abs().max().item() <= tol


def test_the_next_kernel_is_let_in_after_the_main_loop():
    """kd.launch_dependents after the GEMV's loop: the kernel opens with the wait alone and triggers there."""
    args = case(1, 64, 128, 4)
    src = S.qmv_h2_swiglu_prep.triton_source(*args, PER_OUT=8, GROUP_OUT=64,
                                             config={"BLOCK_N": 128, "BLOCK_KW": 8, "STAGES": 3})
    body = src.split("):\n", 1)[1]
    assert body.count("_rt.launch_dependents()") == 1 and "_rt.grid_dependency_sync()" not in body
    assert body.index("_rt.grid_dependency_wait()") < body.index("for ") < body.index("_rt.launch_dependents()")


@CPU_ONLY
def test_row_blocks_that_split_a_group_or_do_not_tile_f_are_refused():
    args = case(1, 96, 64, 4)                                  # F = 96: 64 rows a half do not tile it
    with pytest.raises(Exception, match="divide F"):
        S.qmv_h2_swiglu_prep(*args, PER_OUT=8, GROUP_OUT=32, backend="triton", config={"BLOCK_N": 128, "BLOCK_KW": 8})
    with pytest.raises(Exception, match="whole groups of 64"):
        S.qmv_h2_swiglu_prep(*case(1, 64, 64, 4), PER_OUT=8, GROUP_OUT=64, backend="triton",
                             config={"BLOCK_N": 64, "BLOCK_KW": 8})


def test_the_route_takes_one_wave_of_programs(monkeypatch):
    """serves(): one row of x prepared for the weight, F a multiple of down's group and F / group programs no more
    than the SMs; KILNX_FUSED_SWIGLU=0 turns the kernel off."""
    from kilnx.kernels import dense_mm
    from kilnx.quant import QWeight
    planes, sums, xs, wq, scales, biases = case(1, 256, 64, 4)
    x, w = prepared.PreparedX(planes, sums, xs, torch.float32), QWeight.from_mlx(wq, scales, biases, bits=4,
                                                                                  group_size=64)
    monkeypatch.setattr(dense_mm, "sm_count", lambda t: 3)      # 256 / 64 = 4 programs: past one wave
    assert not S.serves(x, w, (8, 64))
    monkeypatch.setattr(dense_mm, "sm_count", lambda t: 4)
    assert S.serves(x, w, (8, 64)) and not S.serves(x, w, (8, 96)) and not S.serves(x, w, None)
    for value, enabled in (("1", True), ("0", False)):
        monkeypatch.setenv("KILNX_FUSED_SWIGLU", value)
        assert S.enabled() is enabled


@pytest.mark.gpu
def test_on_the_gpu_at_llama_8b_widths_in_a_replayed_graph():
    """gate_up 28672 x 4096 at 1 and 4 rows, the default tile and another: the one launch gives the two launches'
    prepared h, twice over in a replayed CUDA graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    for m in (1, 4):
        args = tuple(t.cuda() for t in case(m, 14336, 4096, 4, seed=m))
        for cfg in (None, {"BLOCK_N": 128, "BLOCK_KW": 128, "num_warps": 8, "STAGES": 3}):
            tile = cfg or S.qmv_h2_swiglu_prep.default_config(*args, PER_OUT=8, GROUP_OUT=64)
            gate_up = H.qmv_h2(*args, config={**tile, "BLOCK_N": 64, "SPLIT_K": 1})
            want = prepared.silu_mul_prep(gate_up, PER=8, GROUP=64)
            run = lambda: S.qmv_h2_swiglu_prep(*args, PER_OUT=8, GROUP_OUT=64, config=cfg)[1:]   # noqa: E731
            run()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = run()
            for _ in range(2):
                for o in outs:
                    o.zero_()
                graph.replay()
                torch.cuda.synchronize()
                x_got, x_want = H._x_of(outs[0], outs[2]), H._x_of(want[0], want[2])
                # the same h but for the odd rounding of a sum taken in another order
                assert (x_got - x_want).abs().max().item() <= 2 ** -7 * x_want.abs().max().item(), cfg
                assert torch.allclose(outs[1], want[1], rtol=2 ** -6, atol=2 ** -7 * want[1].abs().max().item()), cfg
