"""The correctness gate and the CPU timer, in-process with the fake kernels."""

import time

import pytest
import torch

from kilnx.tuner import gate, timing
from tests.tuner.fake_kernels import FAULTY_MODES, ScaleAddKernel, _spin

PROBLEM = {"M": 4, "N": 64}


def _check(kernel, config):
    fn = kernel.compile(config, *kernel.make_args(PROBLEM, "cpu"))
    cases = gate.GateCases(kernel, lambda draw: kernel.make_args(PROBLEM, "cpu"))
    return gate.check(kernel, fn, cases, "cpu")


def test_gate_passes_a_correct_config():
    k = ScaleAddKernel(modes=FAULTY_MODES)
    assert _check(k, {"mode": "ok"}) < 1e-6


@pytest.mark.parametrize("mode, message", [("wrong", "out of tolerance"), ("nan", "NaN"),
                                           ("partial", None)])
def test_gate_rejects_wrong_nan_and_unwritten_outputs(mode, message):
    k = ScaleAddKernel(modes=FAULTY_MODES)
    with pytest.raises(gate.GateFailure, match=message):
        _check(k, {"mode": mode})


def test_gate_cases_hand_out_clones_so_inplace_kernels_cannot_spoil_them():
    k = ScaleAddKernel()
    cases = gate.GateCases(k, lambda draw: k.make_args(PROBLEM, "cpu"))
    for args, _ in cases:
        args[0].zero_()  # an in-place kernel scribbling on its input
    assert all(float(args[0].min()) >= 0.5 for args, _ in cases)


def test_gate_rejects_shape_and_count_mismatch():
    k = ScaleAddKernel()
    x = torch.rand(2, 3)
    with pytest.raises(gate.GateFailure, match="shape"):
        gate.compare(k, (x,), (torch.zeros(3, 2),), (torch.zeros(2, 3),))
    with pytest.raises(gate.GateFailure, match="outputs"):
        gate.compare(k, (x,), (x, x), (x,))


def test_gate_uses_the_kernels_tolerance():
    k = ScaleAddKernel()
    ref, out = torch.ones(4), torch.ones(4) + 0.05
    with pytest.raises(gate.GateFailure):
        gate.compare(k, (), (out,), (ref,))
    k.tolerance = lambda args: (0.0, 0.1)
    assert gate.compare(k, (), (out,), (ref,)) == pytest.approx(0.05, rel=1e-3)


def test_cpu_benchmark_orders_calls_by_cost():
    fast = timing.benchmark(lambda: _spin(20e-6), "cpu")
    slow = timing.benchmark(lambda: _spin(200e-6), "cpu")
    assert 15e-6 < fast < slow
    assert slow > 150e-6


def test_rerank_interleaved_returns_a_median_per_fn_in_order():
    times = timing.rerank_interleaved([lambda: _spin(150e-6), lambda: _spin(15e-6)], "cpu", rounds=3)
    assert len(times) == 2 and times[1] < times[0]
