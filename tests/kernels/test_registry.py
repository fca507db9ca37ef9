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
