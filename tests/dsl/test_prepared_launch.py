"""Repeated Triton calls with the same shapes take a prepared launch (launch._TritonCall): the same
results as the first, general call, fresh outputs each time, zeroed where the kernel asks."""

from __future__ import annotations

import torch
from dsl_helpers import assert_close, randn
from test_tile_kernels import gemv_split_k

from kilnx.codegen.launch import _TritonCall
from kilnx.kernels import activations


def _prepared_calls(kernel):
    return [hit[3] for hit in kernel._calls.values() if isinstance(hit[3], _TritonCall)]


def test_a_split_k_gemv_repeats_through_its_prepared_launch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    w, x = randn(40, 130, dtype=torch.bfloat16, seed=1), randn(130, dtype=torch.bfloat16, seed=2)
    want = w.float() @ x.float()
    gemv_split_k._calls.clear()
    first = gemv_split_k(w, x, config=None)
    assert len(_prepared_calls(gemv_split_k)) == 1
    outs = [gemv_split_k(w, x) for _ in range(2)]     # atomics into an output zeroed per call
    for got in [first, *outs]:
        assert_close(got, want, atol=1e-4, what="split-K GEMV")
    assert len({o.data_ptr() for o in [first, *outs]}) == 3


def test_a_fusion_repeats_through_its_prepared_launch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gate_up = randn(3, 64, seed=3)
    activations.silu_mul_kernel._calls.clear()
    first = activations.silu_mul(gate_up)
    assert len(_prepared_calls(activations.silu_mul_kernel)) == 1
    again = activations.silu_mul(gate_up.clone())
    assert torch.equal(first, again) and again.data_ptr() != first.data_ptr()


def test_the_switch_keeps_calls_on_the_general_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KILNX_PREPARED_LAUNCH", "0")
    gate_up = randn(2, 32, seed=4)
    activations.silu_mul_kernel._calls.clear()
    first = activations.silu_mul(gate_up)
    assert not _prepared_calls(activations.silu_mul_kernel)
    assert torch.equal(activations.silu_mul(gate_up), first)


def test_neither_a_prepared_launch_nor_a_memo_keeps_a_weight_alive(monkeypatch):
    """A prepared launch holds no tensor of its first call, and a PerObjectMemo answer goes with its object:
    a dropped model's weights are freed (a served call keeps a view of its weight, or a repacked copy)."""
    import gc
    import weakref

    from kilnx.dsl.kernel import PerObjectMemo
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    w, x = randn(40, 130, dtype=torch.bfloat16, seed=1), randn(130, dtype=torch.bfloat16, seed=2)
    gemv_split_k._calls.clear()
    gemv_split_k(w, x)
    gemv_split_k(w, x)
    memo = PerObjectMemo()

    class Weight:                                   # a QWeight's part: the memo's key is the weight object
        def __init__(self, t):
            self.packed = t
    key = Weight(w)
    memo.put((key,), "rows", [key.packed[:1]])      # an answer holding a view of its tensor, as a served call does
    assert memo.get((key,), "rows") is not PerObjectMemo.MISSING
    alive = weakref.ref(w)
    del w, key
    gc.collect()
    assert alive() is None and memo._store == {}
