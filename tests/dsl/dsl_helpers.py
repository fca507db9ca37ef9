"""Shared by the DSL tests: backends, dtype tolerances, seeded random inputs."""

from __future__ import annotations

import torch

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def randn(*shape, dtype=torch.float32, seed: int = 0, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(dtype)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at the magnitude of x (as float64)."""
    _, e = torch.frexp(x.double().abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - 1 - MANTISSA_BITS[dtype])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, ulps: float = 2, atol: float = 1e-5,
                 what: str = "") -> None:
    """|actual - expected| <= ulps units in the last place of the dtype + atol, elementwise.

    `expected` is a value in the output's dtype (an fp32 formula rounded once). Two ulps cover the
    fp32 noise that can move a rounding boundary plus the Triton interpreter truncating fp32->bf16.
    fp32 outputs get a relative 1e-5 instead (transcendentals differ in their last bits)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.double(), expected.double()
    if actual.dtype == torch.float32:
        tol = 1e-5 * e.abs() + atol
    else:
        tol = ulps * ulp(e, actual.dtype) + atol
    err = (a - e).abs()
    bad = ~(err <= tol)
    if bad.any():
        i = int(torch.argmax((err - tol).flatten()))
        raise AssertionError(f"{what}: {int(bad.sum())}/{bad.numel()} elements off; worst at flat index {i}: "
                             f"got {a.flatten()[i].item()!r}, expected {e.flatten()[i].item()!r} "
                             f"(tolerance {tol.flatten()[i].item():.3g})")
