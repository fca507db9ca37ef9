"""Sampling properties: seeded reproducibility, greedy = argmax, top-k / top-p support sets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.runtime.sampling import Sampler, SamplingParams, filter_top_k, filter_top_p


def _logits(seed: int, v: int = 50, b: int = 1) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = _logits(0, b=4)
    assert torch.equal(Sampler(SamplingParams())(x), x.argmax(-1))


@given(seed=st.integers(0, 10_000), temp=st.floats(0.1, 2.0))
@settings(max_examples=25, deadline=None)
def test_same_seed_same_tokens(seed, temp):
    x = _logits(seed, b=3)
    p = SamplingParams(temperature=temp, top_p=0.9, seed=seed)
    a = [Sampler(p)(x).tolist() for _ in range(1)] + [Sampler(p)(x).tolist()]
    assert a[0] == a[1]
    s1, s2 = Sampler(p), Sampler(p)
    assert [s1(x).tolist() for _ in range(5)] == [s2(x).tolist() for _ in range(5)]


@given(seed=st.integers(0, 10_000), k=st.integers(1, 49))
@settings(max_examples=40, deadline=None)
def test_top_k_support_is_the_k_largest(seed, k):
    x = _logits(seed)
    kept = torch.isfinite(filter_top_k(x, k))[0]
    assert int(kept.sum()) == k                       # continuous random logits: no ties
    assert set(kept.nonzero().flatten().tolist()) == set(torch.topk(x[0], k).indices.tolist())


@given(seed=st.integers(0, 10_000), p=st.floats(0.01, 0.99))
@settings(max_examples=40, deadline=None)
def test_top_p_support_is_smallest_prefix_reaching_p(seed, p):
    x = _logits(seed)
    kept = torch.isfinite(filter_top_p(x, p))[0]
    probs = torch.softmax(x[0], -1)
    order = torch.argsort(probs, descending=True)
    n = int(kept.sum())
    assert set(order[:n].tolist()) == set(kept.nonzero().flatten().tolist())   # a most-likely prefix
    mass = probs[order].cumsum(0)
    assert mass[n - 1] >= p - 1e-6                     # reaches p ...
    assert n == 1 or mass[n - 2] < p + 1e-6            # ... and is the smallest such prefix


def test_samples_stay_in_support():
    x = _logits(7, v=100)
    s = Sampler(SamplingParams(temperature=1.5, top_k=5, top_p=0.95, seed=3))
    allowed = set(torch.topk(x[0], 5).indices.tolist())
    assert {int(s(x)[0]) for _ in range(200)} <= allowed


def test_sampling_follows_the_distribution():
    x = torch.tensor([[0.0, 1.0, 2.0]])
    s = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = torch.bincount(torch.stack([s(x)[0] for _ in range(3000)]), minlength=3).float() / 3000
    assert torch.allclose(counts, torch.softmax(x[0], -1), atol=0.03)


def test_stop_tokens_and_bad_params():
    s = Sampler(SamplingParams(stop_token_ids=(2, 7)))
    assert s.is_stop(7) and not s.is_stop(3)
    assert not Sampler(SamplingParams(stop_token_ids=(2,), ignore_eos=True)).is_stop(2)
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
