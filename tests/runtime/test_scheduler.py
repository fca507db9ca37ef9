"""Continuous batching (runtime/scheduler.py): requests that share the cache rows and decode steps get what
each would get alone, whatever joins or leaves around them."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from outcomes import Outcomes
from tiny_models import tiny_model

from kilnx.models.errors import ContextLengthError
from kilnx.runtime.engine import Engine
from kilnx.runtime.generate import generate_ids
from kilnx.runtime.sampling import SamplingParams
from kilnx.runtime.request import Finished, split_at_stop
from kilnx.runtime.scheduler import Scheduler, check_prompt


def _prompts(lens, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lens]


def _alone(model, ids, params, max_seq=48):
    return [t for t in generate_ids(Engine(model, max_seq=max_seq), ids, params) if isinstance(t, int)]


def _collect(scheduler, ids, params, stop=()):
    pieces = list(scheduler.stream(ids, params, stop))
    return pieces[:-1], pieces[-1]


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
def test_requests_batched_together_get_the_tokens_each_gets_alone(arch, backend, lookahead):
    """Five greedy requests on three rows: rows are reused as requests end, the batch grows and shrinks,
    and free rows inside it ride along parked; each request's tokens are its tokens decoded alone. With
    lookahead (the GPU's default) each step is enqueued before the previous step's tokens are read, its
    inputs taken on the device; a request that ends meanwhile drops the extra step's token."""
    model = tiny_model(arch, ops=backend.ops, device=backend.device)
    prompts = _prompts((5, 9, 3, 12, 7))
    budgets = (6, 3, 8, 5, 4)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in budgets]
    outcomes = Outcomes(len(prompts))
    with Scheduler(Engine(model, max_seq=48, max_batch=3), lookahead=lookahead) as sched:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            sched.submit(p, sp, outcomes.listener(i))
        done = outcomes.wait(300)
        assert sched.steps < sum(budgets) - len(budgets)     # some steps decoded several rows
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert done[i].reason == "length" and done[i].prompt_tokens == len(p)
        assert list(done[i].token_ids) == _alone(model, p, sp)


def test_a_request_joining_mid_generation_changes_nothing():
    """The second request arrives while the first is decoding (submitted from the first one's listener at
    its third token): both get their solo tokens."""
    model = tiny_model("llama")
    first, second = _prompts((6, 10), seed=5)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    outcomes = Outcomes(2)
    with Scheduler(Engine(model, max_seq=48, max_batch=2)) as sched:
        req = sched.submit(first, sp, outcomes.listener("first"))
        while len(req.tokens) < 3:                     # join once the first has three tokens
            time.sleep(0.001)
        sched.submit(second, sp, outcomes.listener("second"))
        results = outcomes.wait(300)
    assert list(results["first"].token_ids) == _alone(model, first, sp)
    assert list(results["second"].token_ids) == _alone(model, second, sp)


@pytest.mark.parametrize("lookahead", [False, True])
def test_seeded_sampling_is_the_requests_own(lookahead):
    """Two sampled requests with one seed, decoded side by side, draw the same tokens, and those of the
    request alone: each row has its own generator."""
    model = tiny_model("llama")
    p = _prompts((7,), seed=9)[0]
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
    with Scheduler(Engine(model, max_seq=48, max_batch=2), lookahead=lookahead) as sched:
        out = []
        threads = [threading.Thread(target=lambda: out.append(_collect(sched, p, sp)[1])) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert len(out) == 2 and out[0].token_ids == out[1].token_ids
    assert list(out[0].token_ids) == _alone(model, p, sp)


@pytest.mark.parametrize("lookahead", [False, True])
def test_stop_tokens_and_the_context_end(lookahead):
    model = tiny_model("llama")
    p = _prompts((8,), seed=2)[0]
    greedy = _alone(model, p, SamplingParams(max_tokens=6, ignore_eos=True))
    with Scheduler(Engine(model, max_seq=16, max_batch=2), stop_token_ids=(greedy[2],), lookahead=lookahead) as sched:
        _, fin = _collect(sched, p, SamplingParams(max_tokens=6))
        assert fin.reason == "stop" and list(fin.token_ids) == greedy[:3]    # the stop token ends it, counted
        _, fin = _collect(sched, p, SamplingParams(max_tokens=6, ignore_eos=True))
        assert fin.reason == "length" and len(fin.token_ids) == 6
        _, fin = _collect(sched, p, SamplingParams(max_tokens=50, ignore_eos=True))
        assert fin.reason == "length" and len(fin.token_ids) == 16 - 8      # cut at the cache's end
        _, fin = _collect(sched, p, SamplingParams(max_tokens=0))
        assert fin.reason == "length" and fin.token_ids == ()
        with pytest.raises(ContextLengthError, match="shorten the prompt"):
            sched.submit(list(range(3, 19)), SamplingParams(), lambda *e: None)
    with pytest.raises(ContextLengthError, match="lower max_tokens"):
        check_prompt(Engine(model, max_seq=16), 8, 9)
    check_prompt(Engine(model, max_seq=16), 8, 8)


def test_a_cancelled_request_frees_its_row_for_the_next():
    model = tiny_model("llama")
    a, b = _prompts((5, 6), seed=4)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    ended = threading.Event()
    with Scheduler(Engine(model, max_seq=48, max_batch=1)) as sched:
        def on_event(kind, payload):
            if kind == "done":
                assert payload.reason == "cancelled"
                ended.set()
        req = sched.submit(a, sp, on_event)
        while len(req.tokens) < 2:
            time.sleep(0.001)
        req.cancel()
        assert ended.wait(60)
        _, fin = _collect(sched, b, SamplingParams(max_tokens=4, ignore_eos=True))
    assert list(fin.token_ids) == _alone(model, b, SamplingParams(max_tokens=4, ignore_eos=True))


def test_a_failing_listener_does_not_stop_the_scheduler():
    """A listener that raises (a client gone) loses its own request; the scheduler serves the next."""
    model = tiny_model("llama")
    a, b = _prompts((5, 6), seed=6)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    with Scheduler(Engine(model, max_seq=48, max_batch=2)) as sched:
        def broken(kind, payload):
            raise OSError("client went away")
        req = sched.submit(a, SamplingParams(max_tokens=3, ignore_eos=True), broken)
        _, fin = _collect(sched, b, sp)
        assert req.cancelled and sched._thread.is_alive()
    assert list(fin.token_ids) == _alone(model, b, sp)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab\n", max_size=24), cuts=st.lists(st.integers(0, 24), max_size=6),
       stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), min_size=1, max_size=3))
def test_text_streamed_through_stop_strings_is_the_text_before_the_first_stop(text, cuts, stops):
    """However the continuation is cut into pieces, what is emitted is the text up to the stop string that
    ends first (of those ending together, the one that starts first), and nothing is emitted that a later
    piece could turn into part of that stop string."""
    stops = tuple(stops)
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    cut = min(hits)[1] if hits else None
    pieces = [text[i:j] for i, j in zip([0] + sorted(cuts), sorted(cuts) + [len(text)])]
    emitted, held, stopped = "", "", False
    for piece in pieces:
        safe, held, stopped = split_at_stop(held + piece, stops)
        emitted += safe
        assert text.startswith(emitted) and (cut is None or len(emitted) <= cut)
        if stopped:
            break
    if not stopped:
        emitted += held
    assert emitted == (text if cut is None else text[:cut])
    assert stopped == (cut is not None)


def test_a_long_prompt_prefills_in_chunks_between_the_others_steps():
    """A 30-token prompt arriving while a request decodes is prefilled 4 tokens a turn, with a decode step
    of the other between its chunks; both get their solo tokens."""
    model = tiny_model("llama")
    short, long = _prompts((5, 30), seed=12)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    steps_during = []
    results: dict[str, Finished] = {}
    with Scheduler(Engine(model, max_seq=48, max_batch=2), prefill_chunk=4) as sched:
        first = sched.submit(short, sp, lambda k, p: k == "done" and results.__setitem__("short", p))
        while len(first.tokens) < 2:
            time.sleep(0.001)
        second = sched.submit(long, sp, lambda k, p: k == "done" and results.__setitem__("long", p))
        while not second.tokens:
            steps_during.append(sched.steps)
            time.sleep(0.0005)
        while len(results) < 2:
            time.sleep(0.001)
    assert second.prefilled == 30
    assert steps_during[-1] - steps_during[0] >= 3           # the short one kept decoding (8 chunks)
    assert list(results["short"].token_ids) == _alone(model, short, sp)
    assert list(results["long"].token_ids) == _alone(model, long, sp)


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_prompt_that_begins_with_a_rows_last_sequence_prefills_only_the_rest(lookahead):
    """A chat's next turn re-sends the conversation: the row whose cache holds its beginning is chosen, only
    the new tokens are prefilled, and the tokens are those of a prefill from scratch. Another row's steps in
    between (a different request on row 0 parked rows at the parking slot) do not disturb what was kept."""
    model = tiny_model("llama")
    turn1, other, extra = _prompts((9, 7, 6), seed=21)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    with Scheduler(Engine(model, max_seq=48, max_batch=2), lookahead=lookahead) as sched:
        _, first = _collect(sched, turn1, sp)
        assert first.cached_tokens == 0
        _, mid = _collect(sched, other, sp)                   # lands on the other row: nothing shared
        assert mid.cached_tokens == 0
        turn2 = turn1 + list(first.token_ids) + extra
        _, second = _collect(sched, turn2, sp)
        # turn1 and the first four of its tokens were fed in (the fifth was sampled, never fed)
        assert second.cached_tokens == len(turn1) + 4
        again = turn1[:5]                                      # a prompt inside the kept tokens
        _, third = _collect(sched, again, sp)
        assert third.cached_tokens == 4 and sched.cached_tokens == len(turn1) + 8
    assert list(second.token_ids) == _alone(model, turn2, sp)
    assert list(third.token_ids) == _alone(model, again, sp)
    assert list(mid.token_ids) == _alone(model, other, sp)


def test_log_probabilities_of_the_prompt_and_of_each_token_are_the_models():
    """With logprobs, each generated token comes with log-softmax of its step's logits at it and the top-n
    tokens there; with echo, the prompt's tokens too (the first has none), across prefill chunks. The values
    are those of one forward over the whole sequence."""
    from kilnx.runtime.request import TokenLogprob
    model = tiny_model("llama")
    p = _prompts((11,), seed=30)[0]
    events = []
    with Scheduler(Engine(model, max_seq=48, max_batch=2), prefill_chunk=4) as sched:
        done = threading.Event()
        sched.submit(p, SamplingParams(max_tokens=5, ignore_eos=True),
                     lambda k, x: events.append((k, x)) or (k == "done" and done.set()), logprobs=3, echo=True)
        assert done.wait(60)
        fin = events[-1][1]
        infos = [i for k, x in events if k == "logprobs" for i in x]
        seq = p + list(fin.token_ids)
        assert [i.token for i in infos] == seq
        assert infos[0] == TokenLogprob(p[0], None)
        lp = torch.log_softmax(_full_logits(model, seq[:-1]).double(), -1)    # row j predicts token j + 1
        for j, info in enumerate(infos[1:]):
            assert abs(info.logprob - float(lp[j, seq[j + 1]])) < 1e-4
            want = torch.topk(lp[j], 3)
            assert [t for t, _ in info.top] == want.indices.tolist()
            assert all(abs(v - w) < 1e-4 for (_, v), w in zip(info.top, want.values.tolist()))
        for j in range(len(p) - 1, len(seq) - 1):                           # greedy: the top token is the one
            assert infos[j + 1].top[0][0] == seq[j + 1]
        # echo with nothing to generate: the prompt's log-probabilities alone
        events.clear()
        done.clear()
        sched.submit(p, SamplingParams(max_tokens=0), lambda k, x: events.append((k, x)) or (k == "done" and done.set()),
                     logprobs=0, echo=True)
        assert done.wait(60)
        infos = [i for k, x in events if k == "logprobs" for i in x]
        assert [i.token for i in infos] == p and events[-1][1].token_ids == () and infos[1].top == ()


def _full_logits(model, ids):
    from kilnx.runtime.kv_cache import KVCache
    cache = KVCache.for_model(model.config, 1, 64)
    return model.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0]


@pytest.mark.parametrize("lookahead", [False, True])
def test_penalties_count_the_tokens_each_request_generated(lookahead):
    """Greedy with presence, frequency and repetition penalties, two requests side by side: each step's pick
    is the argmax of one forward's last logits after the penalties over that request's own prompt and
    tokens so far (counted on the device, so a step enqueued ahead sees its predecessor's token)."""
    from kilnx.runtime.sampling import apply_penalties
    model = tiny_model("llama")
    sp = SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=0.5, frequency_penalty=1.5,
                        repetition_penalty=1.3)
    prompts = _prompts((6, 9), seed=44)
    with Scheduler(Engine(model, max_seq=48, max_batch=2), lookahead=lookahead) as sched:
        outcomes = Outcomes(2)
        for i, p in enumerate(prompts):
            sched.submit(p, sp, outcomes.listener(i))
        done = outcomes.wait(120)
    for i, p in enumerate(prompts):
        seq, counts, seen = list(p), torch.zeros(1, 256), torch.zeros(1, 256, dtype=torch.bool)
        seen[0, p] = True
        for _ in range(10):
            t = int(apply_penalties(_full_logits(model, seq)[-1:], counts, seen, sp).argmax())
            counts[0, t] += 1
            seen[0, t] = True
            seq.append(t)
        assert list(done[i].token_ids) == seq[len(p):]


@pytest.mark.parametrize("lookahead", [False, True])
def test_requests_arriving_together_with_a_shared_prefix_copy_it_from_the_first(lookahead):
    """Three requests sharing a 20-token prefix (a system prompt) submitted together on three rows, prefill
    chunks of 8 tokens: the first prefills the prefix, the others wait for it to be written, get its K/V
    copied into their rows and prefill only their own tails; each gets its solo tokens."""
    model = tiny_model("llama")
    system = _prompts((20,), seed=50)[0]
    tails = _prompts((5, 7, 3), seed=51)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    with Scheduler(Engine(model, max_seq=48, max_batch=3), lookahead=lookahead, prefill_chunk=8) as sched:
        outcomes = Outcomes(3)
        for i in range(3):
            sched.submit(system + tails[i], sp, outcomes.listener(i))
        done = outcomes.wait(120)
        assert [done[i].cached_tokens for i in range(3)] == [0, 20, 20]
        short = _prompts((10,), seed=52)[0]
        _, a = _collect(sched, short + tails[0], sp)
        _, b = _collect(sched, short + tails[1], sp)        # a's row keeps its 10 shared tokens
        assert b.cached_tokens == 10
    for i in range(3):
        assert list(done[i].token_ids) == _alone(model, system + tails[i], sp)
    assert list(b.token_ids) == _alone(model, short + tails[1], sp)


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_logit_bias_and_min_tokens_steer_one_request_and_not_its_neighbour(lookahead):
    model = tiny_model("llama")
    p, q = _prompts((7, 5), seed=9)
    greedy_q = _alone(model, q, SamplingParams(max_tokens=6, ignore_eos=True))
    with Scheduler(Engine(model, max_seq=48, max_batch=2), stop_token_ids=(5,), lookahead=lookahead) as sched:
        outcomes = Outcomes(2)
        sched.submit(p, SamplingParams(max_tokens=6, logit_bias=((5, 100.0),), min_tokens=3), outcomes.listener(0))
        sched.submit(q, SamplingParams(max_tokens=6, ignore_eos=True), outcomes.listener(1))
        done = outcomes.wait(120)
        forced = done[0]
        assert forced.reason == "stop" and len(forced.token_ids) == 4 and forced.token_ids[-1] == 5
        assert 5 not in forced.token_ids[:3]       # held back for three tokens, then the bias wins
        assert list(done[1].token_ids) == greedy_q
        with pytest.raises(ValueError, match="past the vocabulary"):
            sched.submit(p, SamplingParams(logit_bias=((256, 1.0),)), lambda *e: None)


@pytest.mark.parametrize("budgets", [(8, 8, 2), (8, 2, 8), (2, 9, 3)])
def test_a_high_row_ending_while_its_step_is_in_flight_leaves_the_others_as_they_are(budgets):
    """With lookahead, a row whose request has its last token in flight no longer wants a step, so the next
    step may run fewer rows than the one in flight: only the rows it runs take their tokens from the step in
    flight (the GPU hit an index past the smaller step's rows here)."""
    model = tiny_model("llama")
    prompts = _prompts((4, 6, 5), seed=11)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in budgets]
    outcomes = Outcomes(3)
    with Scheduler(Engine(model, max_seq=48, max_batch=3), lookahead=True) as sched:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            sched.submit(p, sp, outcomes.listener(i))
        done = outcomes.wait(300)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert list(done[i].token_ids) == _alone(model, p, sp)
