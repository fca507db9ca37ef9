"""Kernel references: how a kernel is named across a process boundary.

A worker subprocess cannot receive a kernel object (it holds compiled code and closures), so it gets a
string: a registry name ("rms_norm") or an importable "module.path:attr" (how tests inject fakes).
"""

from __future__ import annotations

import importlib
from typing import Any


class KernelNotFound(LookupError):
    pass


def _registry():
    try:
        from kilnx.kernels import registry
    except ImportError as e:
        raise KernelNotFound(f"the kernel registry (kilnx.kernels.registry) is not available: {e}") from e
    return registry


def resolve(ref: str) -> Any:
    """The kernel object a reference names."""
    if ":" in ref:
        module, _, attr = ref.partition(":")
        try:
            obj = importlib.import_module(module)
        except ImportError as e:
            raise KernelNotFound(f"kernel {ref!r}: cannot import {module!r}: {e}") from e
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise KernelNotFound(f"kernel {ref!r}: {module!r} has no attribute {attr!r}")
            obj = getattr(obj, part)
        return obj
    try:
        return _registry().get(ref)
    except KernelNotFound:
        raise
    except Exception as e:  # noqa: BLE001 - the registry's own error type is not ours to know
        raise KernelNotFound(f"no kernel named {ref!r}: {e}") from e


def all_registered() -> list[tuple[str, Any]]:
    """(ref, kernel) for every registered kernel."""
    return [(k.name, k) for k in _registry().all()]


def problems_for_model(model: str, gpu: bool = True) -> list[tuple[str, dict]]:
    return list(_registry().problems_for_model(model, gpu=gpu))


def step_tuned() -> frozenset:
    """Kernels tuned in a model's decode step when named, never call by call (kilnx/kernels/registry.py STEP_TUNED)."""
    return frozenset(getattr(_registry(), "STEP_TUNED", ()))
