"""Sampling properties: seeded reproducibility, greedy = argmax, top-k / top-p support sets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.runtime.sampling import Sampler, SamplingParams, filter_min_p, filter_top_k, filter_top_p


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


@given(seed=st.integers(0, 10_000), p=st.floats(0.0, 1.0), temperature=st.floats(0.3, 2.0))
@settings(max_examples=40, deadline=None)
def test_min_p_keeps_the_tokens_at_least_p_times_as_likely_as_the_likeliest(seed, p, temperature):
    x = _logits(seed) / temperature
    kept = torch.isfinite(filter_min_p(x, p))[0]
    probs = torch.softmax(x[0].double(), -1)
    near = (probs - p * probs.max()).abs() < 1e-9 * probs.max()          # the threshold's own rounding
    assert torch.equal(kept[~near], (probs >= p * probs.max())[~near])
    assert kept[probs.argmax()]


def test_min_p_one_leaves_the_likeliest_token():
    x = _logits(3, v=100)
    s = Sampler(SamplingParams(temperature=1.3, min_p=1.0, seed=1))
    assert {int(s(x)[0]) for _ in range(50)} == {int(x[0].argmax())}
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


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


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), presence=st.floats(-2, 2), frequency=st.floats(-2, 2),
       repetition=st.floats(0.5, 2.0))
def test_penalties_are_openais_and_hfs_formulas(seed, presence, frequency, repetition):
    """presence / frequency (OpenAI): logit - frequency * count - presence * [count > 0] over generated tokens;
    repetition (HF, vLLM): a prompt or output token's logit divided by it where positive, multiplied where
    negative. Tokens neither generated nor in the prompt keep their logit."""
    from kilnx.runtime.sampling import apply_penalties
    x = _logits(seed, v=20)
    prompt, generated = [1, 2, 3], [3, 5, 5, 7]
    p = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
    s = Sampler(p)
    s.start(prompt, 20)
    for t in generated:
        s.observe(torch.tensor([t]))
    got = apply_penalties(x, s.counts, s.seen, p)[0]
    for t in range(20):
        v = float(x[0, t])
        if t in prompt or t in generated:
            v = v / repetition if v > 0 else v * repetition
        n = generated.count(t)
        v -= frequency * n + presence * (n > 0)
        assert abs(float(got[t]) - v) < 1e-4


def test_a_penalized_greedy_pick_avoids_what_was_generated():
    x = torch.zeros(1, 10)
    x[0, 4], x[0, 6] = 5.0, 4.0
    s = Sampler(SamplingParams(frequency_penalty=2.0))
    s.start([], 10)
    assert int(s(x)[0]) == 4
    s.observe(torch.tensor([4]))
    assert int(s(x)[0]) == 6                       # 5 - 2 < 4
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)


def test_logit_bias_is_added_and_min_tokens_holds_the_stop_tokens_back():
    x = torch.zeros(1, 10)
    x[0, 2], x[0, 7] = 3.0, 1.0
    s = Sampler(SamplingParams(logit_bias=((7, 2.5), (2, -0.5)), min_tokens=2, stop_token_ids=(7,)))
    s.start([], 10)
    assert int(s(x)[0]) == 2                       # 3 - 0.5 > 1 + 2.5 is false, but 7 is held back
    s.observe(torch.tensor([2]))
    assert int(s(x)[0]) == 2
    s.observe(torch.tensor([2]))
    assert int(s(x)[0]) == 7                       # two generated: 7 may end it now (3.5 > 2.5)
    later = Sampler(SamplingParams(min_tokens=1))
    later.start([], 10, stop_token_ids=(2,))       # the caller's stop tokens count too
    assert int(later(x)[0]) == 7
    with pytest.raises(ValueError, match="past the vocabulary"):
        Sampler(SamplingParams(logit_bias=((10, 1.0),))).start([], 10)
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias=((1, 101.0),))
