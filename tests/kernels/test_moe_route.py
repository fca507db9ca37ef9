"""kernels/moe_route.py: the router's top-k is the top-k of a float64 softmax (numpy), ties to the lower
expert, weights renormalized or not; on the Triton interpreter, numba and the reference interpreter."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels.moe_route import moe_route, moe_topk, moe_topk_sigmoid

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")


def numpy_route(logits: np.ndarray, k: int, norm: bool):
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]          # stable: equal values keep index order
    w = np.take_along_axis(p, ids, 1)
    return ids, (w / w.sum(1, keepdims=True) if norm else w)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(T=st.sampled_from([1, 3, 17]), E=st.sampled_from([4, 6, 8, 60, 128]), k=st.sampled_from([1, 2, 4, 8]),
       norm=st.booleans(), rows=st.sampled_from([1, 2, 8]), ties=st.booleans(), seed=st.integers(0, 99))
def test_top_k_of_the_softmax(T, E, k, norm, rows, ties, seed):
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 3
    if ties:   # duplicated logits, some at the top: the lower expert comes first
        logits[:, E // 2:] = logits[:, : E - E // 2]
        logits[0, :2] = logits.max() + 1
    ids, w = moe_topk(logits, TOP_K=k, NORM=norm, backend="triton", config={"ROWS": rows})
    want_ids, want_w = numpy_route(logits.numpy(), k, norm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_other_backends(backend):
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(1)).bfloat16()
    ids, w = moe_topk(logits, TOP_K=3, NORM=True, backend=backend, config={"ROWS": 2})
    want_ids, want_w = numpy_route(logits.float().numpy(), 3, True)
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-5, atol=1e-7)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="0 < top_k <= experts"):
        moe_route(torch.zeros(2, 4), 5, True)
    with pytest.raises(ValueError, match=r"\(tokens, experts\)"):
        moe_route(torch.zeros(2, 4, 1), 1, True)


def numpy_sigmoid_route(logits: np.ndarray, bias: np.ndarray, k: int, norm: bool, scale: float):
    s = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    ids = np.argsort(-(s + bias), axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(s, ids, 1)
    return ids, (w / (w.sum(1, keepdims=True) + 1e-20) if norm else w) * scale


@settings(max_examples=10, deadline=None, derandomize=True)
@given(T=st.sampled_from([1, 3, 17]), E=st.sampled_from([4, 8, 60, 128]), k=st.sampled_from([1, 2, 6]),
       norm=st.booleans(), scale=st.sampled_from([1.0, 2.5]), rows=st.sampled_from([1, 2, 8]), ties=st.booleans(),
       seed=st.integers(0, 99))
def test_sigmoid_routing_chooses_by_score_plus_bias_and_weighs_by_score(T, E, k, norm, scale, rows, ties, seed):
    """DeepSeek-V3's / nemotron-3's router: the correction bias moves the choice (here by as much as the scores
    differ), not the weights; the chosen scores renormalized or not, times the scaling factor."""
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.3
    if ties:   # equal scores plus equal biases: the lower expert comes first
        logits[:, E // 2:] = logits[:, : E - E // 2]
        bias[E // 2:] = bias[: E - E // 2]
    want_ids, want_w = numpy_sigmoid_route(logits.numpy(), bias.numpy(), k, norm, scale)
    for backend, cfg in (("triton", {"ROWS": rows}), ("reference", {"ROWS": 2})):
        ids, w = moe_topk_sigmoid(logits, bias, TOP_K=k, NORM=norm, SCALE=scale, backend=backend, config=cfg)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32
        np.testing.assert_array_equal(ids.numpy(), want_ids)
        np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-5, atol=1e-7)


def test_the_bias_chooses_and_the_scores_weigh():
    """Equal logits: the bias alone picks the experts (the largest biases), and each weighs its score's share."""
    logits = torch.zeros(2, 8)
    bias = torch.tensor([0.0, 0.3, -0.1, 0.5, 0.2, 0.0, 0.4, -0.5])
    ids, w = moe_topk_sigmoid(logits, bias, TOP_K=3, NORM=True, SCALE=2.5, backend="triton", config={"ROWS": 2})
    assert ids.tolist() == [[3, 6, 1]] * 2
    np.testing.assert_allclose(w.numpy(), np.full((2, 3), 2.5 / 3), rtol=1e-6)
    _, w = moe_topk_sigmoid(logits, bias, TOP_K=3, NORM=False, SCALE=1.0, backend="triton", config={"ROWS": 2})
    np.testing.assert_allclose(w.numpy(), np.full((2, 3), 0.5), rtol=1e-6)   # sigmoid(0), the bias left out


def test_sigmoid_routing_on_numba_and_through_the_op():
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = torch.linspace(-0.2, 0.2, 12)
    want_ids, want_w = numpy_sigmoid_route(logits.float().numpy(), bias.numpy(), 3, True, 2.5)
    for ids, w in (moe_topk_sigmoid(logits, bias, TOP_K=3, NORM=True, SCALE=2.5, backend="numba", config={"ROWS": 2}),
                   moe_route(logits, 3, True, scoring="sigmoid", bias=bias, scale=2.5)):
        np.testing.assert_array_equal(ids.numpy(), want_ids)
        np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="one value per expert"):
        moe_route(logits, 3, True, scoring="sigmoid", bias=bias[:5])
    with pytest.raises(ValueError, match="scoring='sigmoid'"):
        moe_route(logits, 3, True, bias=bias)
