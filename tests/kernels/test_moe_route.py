"""kernels/moe_route.py: the router's top-k is the top-k of a float64 softmax (numpy), ties to the lower
expert, weights renormalized or not; on the Triton interpreter, numba and the reference interpreter."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels.moe_route import moe_route, moe_topk

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
