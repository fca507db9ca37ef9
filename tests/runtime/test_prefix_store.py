"""Kept prefixes beyond the cache rows (runtime/prefix_store.py): more conversations than rows keep their
histories, each next turn prefills only its new tokens, and the tokens are those of a prefill from scratch."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from kilnx.runtime.engine import Engine
from kilnx.runtime.generate import generate_ids
from kilnx.runtime.kv_cache import KVCache
from kilnx.runtime.prefix_store import PrefixStore
from kilnx.runtime.sampling import SamplingParams
from kilnx.runtime.scheduler import Scheduler


def _cache(rows=2, seq=40):
    g = torch.Generator().manual_seed(0)
    return KVCache([torch.randn(rows, 2, seq, 4, generator=g) for _ in range(3)],
                   [torch.randn(rows, 2, seq, 4, generator=g) for _ in range(3)])


def test_the_store_copies_prefixes_out_and_back_and_gives_up_the_least_recently_used():
    rows = _cache()
    store = PrefixStore(rows, 2, min_tokens=4)
    a, b, c = list(range(20)), list(range(100, 110)), list(range(200, 212))
    store.save(a, rows, 0)
    store.save(b, rows, 1)
    assert store.best(a + [7, 7], 99) == (0, 20) and store.best(b[:6] + [1], 99) == (1, 6)
    target = _cache(seq=40)
    store.load(0, 20, target, 1)                  # a is now the most recently used
    for mine, theirs in zip(target.k + target.v, rows.k + rows.v):
        assert torch.equal(mine[1, :, :20], theirs[0, :, :20])
    store.save(c, rows, 0)                        # gives up b
    assert store.best(b, 99) == (None, 0) and store.best(a, 99)[1] == 20 and store.saved == 3
    store.save(a[:12], rows, 0)                   # inside an entry: nothing copied
    store.save(c + [5] * 8, rows, 1)              # extends c: replaces it, keeps a
    assert store.saved == 4 and store.best(c + [5] * 8, 99)[1] == 20 and store.best(a, 99)[1] == 20
    store.save([1, 2], rows, 0)                   # shorter than min_tokens: not worth a slot
    assert store.saved == 4
    store.save(b, rows, 0, keep_slot=store.best(a, 99)[0])   # never the slot about to be loaded
    assert store.best(a, 99)[1] == 20
    with pytest.raises(ValueError, match="at least one slot"):
        PrefixStore(rows, 0)


def test_an_exchange_swaps_a_stored_prefix_with_the_rows_kept_one_in_one_slot():
    rows = _cache()
    before = [t.clone() for t in rows.k + rows.v]
    store = PrefixStore(rows, 1, min_tokens=4)
    a, b = list(range(30)), list(range(50, 75))
    store.save(a, rows, 0)
    store.exchange(0, 30, b, rows, 1)             # a into row 1, row 1's b into a's slot
    for now, was in zip(rows.k + rows.v, before):
        assert torch.equal(now[1, :, :30], was[0, :, :30])
    assert store.best(b, 99) == (0, 25) and store.best(a, 99) == (None, 0)
    target = _cache()
    store.load(0, 25, target, 0)
    for got, was in zip(target.k + target.v, before):
        assert torch.equal(got[0, :, :25], was[1, :, :25])


def _conversation_turns(sched, prompts, sp):
    out = []
    for p in prompts:
        fin = list(sched.stream(p, sp))[-1]
        out.append(fin)
    return out


@pytest.mark.parametrize("lookahead", [False, True])
def test_three_conversations_on_one_row_keep_their_histories(lookahead):
    """Three conversations take turns on a one-row engine: without a store each turn prefills its whole
    history (the row held another conversation); with two slots every second turn reuses all it sent before."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(5)
    first = [torch.randint(3, 256, (20 + 3 * i,), generator=g).tolist() for i in range(3)]
    extra = [torch.randint(3, 256, (4,), generator=g).tolist() for _ in range(3)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)

    def run(slots):
        with Scheduler(Engine(model, max_seq=64, max_batch=1), lookahead=lookahead, prefix_slots=slots) as sched:
            turn1 = _conversation_turns(sched, first, sp)
            second = [p + list(f.token_ids) + e for p, f, e in zip(first, turn1, extra)]
            turn2 = _conversation_turns(sched, second, sp)
            return second, turn2, sched
    second, plain, _ = run(0)
    assert [f.cached_tokens for f in plain] == [0, 0, 0]
    second_s, stored, sched = run(2)
    assert second_s == second
    # each second turn finds its first turn's prompt and the three tokens fed back in
    assert [f.cached_tokens for f in stored] == [len(p) + 3 for p in first]
    assert sched.store.loaded == 3
    for p, f, q in zip(second, stored, plain):
        alone = [t for t in generate_ids(Engine(model, max_seq=64), p, sp) if isinstance(t, int)]
        assert list(f.token_ids) == alone == list(q.token_ids)


def test_one_slot_keeps_only_the_last_conversation_given_up():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(6)
    a, b, c = (torch.randint(3, 256, (24,), generator=g).tolist() for _ in range(3))
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    with Scheduler(Engine(model, max_seq=64, max_batch=1), prefix_slots=1) as sched:
        ta, tb, tc = _conversation_turns(sched, [a, b, c], sp)     # a given up for b, then b for c
        a2, b2 = a + list(ta.token_ids), b + list(tb.token_ids)
        fa, fb = _conversation_turns(sched, [a2, b2], sp)
    assert fa.cached_tokens == 0                  # a was given up when b's history was stored
    assert fb.cached_tokens == 0                  # c's history took the slot when a's turn came in
