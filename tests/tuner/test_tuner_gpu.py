"""On an NVIDIA GPU (run with `-m gpu` on the device machine): CUDA-graph timing and a real tune."""

import pytest
import torch

from kilnx.tuner import timing
from tests.tuner.helpers import run_tune

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from kilnx.runtime.device import detect
    return detect("cuda")


def test_cuda_timing_orders_matmuls_by_size(cuda):
    small = torch.rand(1024, 1024, device="cuda")
    big = torch.rand(4096, 4096, device="cuda")
    t_small = timing.benchmark(lambda: small @ small, "cuda:0")
    t_big = timing.benchmark(lambda: big @ big, "cuda:0")
    assert 0 < t_small < t_big < 0.1
    assert t_big / t_small > 8  # 64x the flops; launch overhead must not flatten that
    times = timing.rerank_interleaved([lambda: big @ big, lambda: small @ small], "cuda:0", rounds=3)
    assert times[1] < times[0]


def test_cuda_timing_falls_back_when_capture_fails(cuda):
    x = torch.rand(1024, device="cuda")
    assert timing.benchmark(lambda: x.sum().item(), "cuda:0") > 0  # .item() syncs: not capturable


def test_tune_on_the_gpu(sqlite_url, cuda):
    [r] = run_tune(sqlite_url, cuda, ["gpu_scale_add"], trials=13, trial_timeout_s=60)
    assert r.error == "" and r.config == {"BLOCK": 16, "unroll": True}
    assert r.default_time_s > r.time_s
