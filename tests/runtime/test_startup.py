"""A start-up's kernels remembered and built ahead: what one process launched, the next builds before
its first launch, and that launch then finds the build done."""

from __future__ import annotations

import pytest
import torch

from kilnx.dsl.fusion import FusionKernel
from kilnx.dsl.kernel import TileKernel
from kilnx.kernels import activations, rope
from kilnx.runtime import startup


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("KILNX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "1")      # the triton backend, on CPU tensors
    monkeypatch.setattr(startup, "_entries", [])
    monkeypatch.setattr(startup, "_seen", set())
    monkeypatch.setattr(startup, "_saved_upto", {})
    return tmp_path


def _forget(*kernels):
    """What a new process has: no builds, no remembered calls."""
    for k in kernels:
        k._compiled.clear()
        k._calls.clear()


def _run():
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(3, 64, generator=g)
    q, k = torch.randn(2, 4, 16, generator=g), torch.randn(2, 2, 16, generator=g)
    positions = torch.tensor([3, 7])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    rope.rope_kernel(q, k, positions, inv_freq)
    return activations.silu_mul(gate_up), q, k


def test_the_next_start_builds_ahead_what_this_one_launched(fresh, monkeypatch):
    kernels = (activations.silu_mul_kernel, rope.rope_kernel)
    _forget(*kernels)
    want = _run()
    startup.save("model")
    lines = (fresh / "startup" / "model.txt").read_text().splitlines()
    assert sorted(eval(line)[1] for line in lines) == ["rope_kernel", "silu_mul_kernel"]  # noqa: S307
    # a stale entry and a garbled line are passed over
    with open(fresh / "startup" / "model.txt", "a") as f:
        f.write("('kilnx.kernels.activations', 'gone_kernel', 'triton', {}, (), {})\n(unreadable\n")

    _forget(*kernels)
    assert startup.prebuild("model") == 2
    for cls in (FusionKernel, TileKernel):      # the launches must find their builds done
        monkeypatch.setattr(cls, "_build", lambda *a, **k: pytest.fail("built again at launch"))
    got = _run()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_runtime_scalars_are_kept_by_type_only(fresh):
    _forget(activations.scaled_add_kernel)
    x = torch.randn(2, 32)
    activations.scaled_add(x, torch.randn(2, 32), 0.37)
    startup.save("m")
    entry = eval((fresh / "startup" / "m.txt").read_text().splitlines()[0])  # noqa: S307
    assert entry[1] == "scaled_add_kernel" and entry[5] == {"scale": 0.0}


def test_no_manifest_builds_nothing(fresh):
    assert startup.prebuild("never-saved") == 0
