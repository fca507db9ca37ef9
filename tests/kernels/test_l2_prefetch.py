"""L2 prefetch of a GEMV's first weight rows: which lines it asks for, where a model asks, and that it never
changes a value. The lines are observed through the reference interpreter (the specification of what each
program touches); the GPU tests check that a decode step with prefetches computes what it computes without."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.codegen import reference
from kilnx.kernels import l2_prefetch as P
from kilnx.kernels.qmatmul import make_qmatmul_args
from kilnx.quant import QWeight

BACKENDS = ["reference", "numba"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


def _weight(n: int, k: int, device="cpu") -> QWeight:
    _, wq, s, b = make_qmatmul_args({"M": 1, "N": n, "K": k, "bits": 4, "gs": 64}, device)
    return QWeight.from_mlx(wq, s, b, bits=4, group_size=64)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 40), k=st.sampled_from([64, 256, 512]), frac=st.floats(0, 1.2),
       lines=st.sampled_from([8, 32]))
def test_the_prefetch_asks_for_every_line_of_the_first_rows_and_no_other(n, k, frac, lines):
    asked: dict[str, set] = {}
    lanes = reference.Interpreter._lanes

    def recording(self, node, v, first_idx):
        arr, idx, mask = lanes(self, node, v, first_idx)
        if node.op == "prefetch":
            flat = np.ravel_multi_index(tuple(np.asarray(i).ravel() for i in idx), arr.shape)
            asked.setdefault(node.arg[0], set()).update(flat.tolist())   # element indices
        return arr, idx, mask

    w = _weight(n, k)
    rows = int(frac * n)
    reference.Interpreter._lanes = recording
    try:
        P.prefetch_rows(w, rows, backend="reference", config={"LINES": lines, "num_warps": 1})
    finally:
        reference.Interpreter._lanes = lanes
    for name, t in (("a", w.packed), ("b", w.scales), ("c", w.biases)):
        nbytes = min(rows, n) * t.shape[1] * t.element_size()
        lines_named = {i * t.element_size() // P.LINE_BYTES for i in asked.get(name, ())}
        assert lines_named == set(range(-(-nbytes // P.LINE_BYTES))), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_prefetch_runs_on_every_backend_and_writes_nothing(backend):
    w = _weight(24, 256)
    before = [t.clone() for t in (w.packed, w.scales, w.biases)]
    for rows in (0, 5, 24, 100):
        P.prefetch_rows(w, rows, backend=backend)
    for a, b in zip(before, (w.packed, w.scales, w.biases)):
        assert torch.equal(a, b)


def test_the_prefetch_kernel_lets_the_next_kernel_start_then_waits_after_its_prefetches():
    w = _weight(24, 256)
    flat = [t.reshape(-1) for t in (w.packed, w.scales, w.biases)]
    src = P.l2_prefetch_kernel.triton_source(*flat, a_stop=10, b_stop=4, c_stop=4, PROGRAMS=4)
    body = [ln.strip() for ln in src.split("):\n", 1)[1].splitlines()]
    assert body[0] == "_rt.launch_dependents()"
    assert body[-1] == "_rt.grid_dependency_wait()"
    assert "_rt.grid_dependency_sync()" not in body and sum("_rt.prefetch_l2(" in ln for ln in body) == 3


def test_prefetch_weights_does_nothing_on_the_cpu_past_decode_rows_or_when_off(monkeypatch):
    calls = []
    monkeypatch.setattr(P, "prefetch_rows", lambda w, rows, **_: calls.append(rows))
    w = _weight(24, 256)
    P.prefetch_weights([w], torch.zeros(1, 256), "o", budget=1 << 20)          # CPU
    assert calls == []

    class OnGpu:   # stands for activations on a GPU: only their device and shape are read
        def __init__(self, rows):
            self.device, self.shape = torch.device("cuda"), (rows, 256)

    P.prefetch_weights([w], OnGpu(17), "o", budget=1 << 20)
    P.prefetch_weights([w], OnGpu(1), "o", budget=0)
    assert calls == []
    per_row = 256 // 8 * 4 + 2 * (256 // 64) * 2
    P.prefetch_weights([w, torch.zeros(3, 3), w], OnGpu(4), "o", budget=30 * per_row)   # dense parts are skipped
    assert calls == [30, 6]        # the first weight whole (24 rows), the rest of the budget from the next


def test_only_the_chosen_sites_prefetch(monkeypatch):
    calls = []
    monkeypatch.setattr(P, "prefetch_rows", lambda w, rows, **_: calls.append(rows))
    monkeypatch.setattr(P, "sites", lambda: frozenset({"o"}))

    class OnGpu:
        device, shape = torch.device("cuda"), (1, 256)

    w = _weight(24, 256)
    P.prefetch_weights([w], OnGpu(), "down", budget=1 << 20)
    P.prefetch_weights([w], OnGpu(), "o", budget=1 << 20)
    assert calls == [(1 << 20) // (256 // 8 * 4 + 2 * (256 // 64) * 2)]   # rows of the budget (clamped by prefetch_rows)


def test_an_unknown_site_in_the_environment_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("KILNX_L2_PREFETCH_SITES", "o,attention")
    P.sites.cache_clear()
    try:
        with pytest.raises(ValueError, match="unknown \\['attention'\\]"):
            P.sites()
    finally:
        monkeypatch.delenv("KILNX_L2_PREFETCH_SITES")
        P.sites.cache_clear()
