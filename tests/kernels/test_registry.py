"""What `kilnx tune --model` asks for exists: every (kernel, problem) a zoo preset needs names a registered
kernel that the tuner can make inputs for, on the GPU's kernel choice and on the CPU's."""

from __future__ import annotations

import pytest

from kilnx.kernels import registry
from kilnx.models.presets import PRESETS


@pytest.mark.parametrize("gpu", [True, False])
@pytest.mark.parametrize("model", sorted(PRESETS))
def test_every_problem_of_a_preset_names_a_tunable_kernel(model, gpu):
    problems = registry.problems_for_model(model, gpu=gpu)
    assert problems
    for name, _ in problems:
        kernel = registry.get(name)
        assert kernel.make_args is not None, f"{model}: {name} has no tuning inputs"


def test_an_moe_preset_tunes_the_decode_moe_the_runtime_runs():
    gpu = {name for name, _ in registry.problems_for_model("qwen3-30b-a3b", gpu=True)}
    cpu = {name for name, _ in registry.problems_for_model("qwen3-30b-a3b", gpu=False)}
    assert {"gather_qmv_h2_glu", "gather_qmv_h2_combine", "gather_qmm_glu", "moe_align_scatter"} <= gpu
    assert {"gather_qmv_glu", "gather_qmv_combine"} <= cpu and not {"gather_qmv_h2_glu"} & cpu


def test_nemotron_3_tunes_the_kernels_of_its_ungated_experts():
    """relu² experts run up, then down with the combine (kernels/moe.py's ungated path), not the GLU kernels: at
    decode the packed-fp16 ones on the GPU, the per-slot GEMVs on the CPU; grouped GEMMs at prefill, whose combine is
    atomic on the GPU and, on the CPU, weighted slot rows summed by moe_sum_slots (what each runs)."""
    gpu = {name for name, _ in registry.problems_for_model("nemotron-3-nano-30b-a3b", gpu=True)}
    cpu = {name for name, _ in registry.problems_for_model("nemotron-3-nano-30b-a3b", gpu=False)}
    assert {"gather_qmv_h2_act", "gather_qmv_h2_combine", "gather_qmm", "gather_qmm_combine"} <= gpu
    assert {"gather_qmv", "gather_qmv_combine", "gather_qmm", "moe_sum_slots"} <= cpu
    assert "gather_qmm_combine" not in cpu and "moe_sum_slots" not in gpu
    assert not {"gather_qmv_h2_glu", "gather_qmm_glu", "gather_qmv_glu"} & (gpu | cpu)


def test_a_gpu_tune_times_the_gemm_each_prompt_size_runs():
    """From 320 rows (above 128 on starved grids) the GPU dequantizes once and runs the dense `mm`
    (kernels/routing.py): a GPU tune times `mm` at the prefill sizes and the fused qmm below them; the CPU, which has no two-kernel path,
    tunes the fused qmm at every size."""
    gpu = registry.problems_for_model("llama-3.1-8b", gpu=True)
    cpu = registry.problems_for_model("llama-3.1-8b", gpu=False)
    assert {p["M"] for n, p in gpu if n == "mm"} == {512, 2048}
    assert {p["M"] for n, p in gpu if n == "qmm"} == {16, 128}
    assert {p["M"] for n, p in cpu if n == "qmm"} == {16, 512, 2048} and not [n for n, _ in cpu if n == "mm"]


def test_the_dense_gemm_tunes_against_its_reference():
    """`mm`'s tuning inputs, its seeds and its peer agree with its numpy-defined result (a small problem)."""
    import torch
    mm = registry.get("mm")
    args = mm.make_args({"M": 32, "N": 64, "K": 128}, "cpu")
    want = mm.reference(*args).float()
    assert torch.allclose(mm.peer(*args).float(), want, rtol=2e-2, atol=1e-2)
    rtol, atol = mm.tolerance(args)
    for cfg in mm.seed_configs({"M": 32, "N": 64, "K": 128})[:2]:
        got = mm(*args, config={**cfg, "TMA": False}, backend="reference").float()
        assert torch.allclose(got, want, rtol=rtol, atol=atol)


def test_a_gpu_tune_times_the_wgmma_kernel_where_batched_decode_runs_it():
    """On the GPU 4-16 row calls of gs64 weights go to qmm_wg_direct (kernels/routing.py): a tune times it at 4
    and 16 rows of every projection; the bundled gs32 presets and the CPU keep their GEMVs."""
    gpu = registry.problems_for_model("llama-3.1-8b", gpu=True)
    shapes = {(p["N"], p["K"]) for n, p in gpu if n == "qmv_h2"}
    assert {(p["M"], p["N"], p["K"]) for n, p in gpu if n == "qmm_wg_direct"} == {(m, n, k) for m in (4, 16)
                                                                                  for n, k in shapes}
    assert {p["M"] for n, p in gpu if n == "qmv_h2"} == {1}
    for model, gpu_ in (("smollm2-135m", True), ("llama-3.1-8b", False)):
        assert "qmm_wg_direct" not in {n for n, _ in registry.problems_for_model(model, gpu=gpu_)}
