"""Kept prefixes beyond the cache rows: the K/V of sequences whose rows were given to other requests.

Why: the scheduler's rows keep what the last sequence wrote, so a conversation's next turn prefills only its
new tokens — but only while its row is not given to someone else. With more conversations than rows (a
server's usual case), each new turn would prefill its whole history again. The store is a second static
cache of `slots` rows: a row's kept tokens are copied into it before the row is overwritten, and a prompt
that begins with a stored sequence gets that prefix copied back (a copy of positions, 2 x layers tensor
copies, against a prefill of them). The least recently used entry is given up first.

What it is not: a block-level (paged) cache shared in place. An entry is a whole sequence's prefix, copied in
and out; an entry that another entry begins with is not stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from kilnx.runtime.kv_cache import KVCache


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most `limit`."""
    n, limit = 0, min(len(a), len(b), limit)
    while n < limit and a[n] == b[n]:
        n += 1
    return n


@dataclass
class _Entry:
    tokens: list[int]
    used: int                     # the store's clock at its last save or load (least recent goes first)


class PrefixStore:
    """`slots` stored prefixes of up to the cache's max_seq tokens, in a KVCache shaped like `like`'s rows."""

    def __init__(self, like: KVCache, slots: int, *, min_tokens: int = 16):
        if slots < 1:
            raise ValueError(f"a prefix store needs at least one slot, got {slots}")
        k, v = like.k[0], like.v[0]
        self.cache = KVCache([k.new_zeros((slots, *k.shape[1:])) for _ in like.k],
                             [v.new_zeros((slots, *v.shape[1:])) for _ in like.v])
        self.entries: list[_Entry | None] = [None] * slots
        self.min_tokens = min_tokens     # shorter sequences are cheaper to prefill than to keep track of
        self._clock = 0
        self.saved = self.loaded = 0     # copies made, for telemetry and tests

    def _tick(self, entry: _Entry) -> None:
        self._clock += 1
        entry.used = self._clock

    def best(self, ids: list[int], limit: int) -> tuple[int | None, int]:
        """(slot, n): the entry sharing the longest prefix with ids (n <= limit), or (None, 0)."""
        slot, have = None, 0
        for i, e in enumerate(self.entries):
            n = common_prefix(e.tokens, ids, limit) if e is not None else 0
            if n > have:
                slot, have = i, n
        return slot, have

    def _held(self, tokens: list[int], *, besides: int | None = None) -> bool:
        """Whether `tokens` need no slot: too short to keep, or the beginning of an entry (not `besides`)."""
        if len(tokens) < self.min_tokens:
            return True
        for i, e in enumerate(self.entries):
            if i != besides and e is not None and common_prefix(e.tokens, tokens, len(tokens)) == len(tokens):
                self._tick(e)
                return True
        return False

    def save(self, tokens: list[int], source: KVCache, row: int, *, keep_slot: int | None = None) -> None:
        """Store the K/V at positions [0, len(tokens)) of `source`'s row (what `tokens` wrote there). Nothing is
        copied when an entry already begins with `tokens`; an entry that `tokens` begins with is replaced;
        otherwise the least recently used slot (never `keep_slot`) is given up."""
        if self._held(tokens):
            return
        victims = [i for i in range(len(self.entries)) if i != keep_slot]
        if not victims:
            return
        covered = [i for i in victims if self.entries[i] is not None
                   and common_prefix(self.entries[i].tokens, tokens, len(self.entries[i].tokens))
                   == len(self.entries[i].tokens)]
        slot = covered[0] if covered else min(victims, key=lambda i: -1 if self.entries[i] is None
                                              else self.entries[i].used)
        self.cache.copy_prefix_from(source, row, slot, len(tokens))
        self._put(slot, tokens)

    def load(self, slot: int, n: int, target: KVCache, row: int) -> None:
        """Copy the first n positions of entry `slot` into `target`'s row."""
        target.copy_prefix_from(self.cache, slot, row, n)
        self._tick(self.entries[slot])
        self.loaded += 1

    def exchange(self, slot: int, n: int, tokens: list[int], cache: KVCache, row: int) -> None:
        """Load the first n positions of entry `slot` into `cache`'s row, whose K/V `tokens` wrote, and store
        those in that slot: the sequence coming in from the store no longer needs its slot (its row will hold
        it, and give it back extended), so one slot serves both and no other entry is given up. A layer's
        slice is the only temporary."""
        if self._held(tokens, besides=slot):
            self.load(slot, n, cache, row)
            return
        m = len(tokens)
        for mine, theirs in zip(self.cache.k + self.cache.v, cache.k + cache.v):
            leaving = theirs[row, :, :m].clone()
            theirs[row, :, :n].copy_(mine[slot, :, :n])
            mine[slot, :, :m].copy_(leaving)
        self._put(slot, tokens)
        self.loaded += 1

    def _put(self, slot: int, tokens: list[int]) -> None:
        self.entries[slot] = _Entry(list(tokens), 0)
        self._tick(self.entries[slot])
        self.saved += 1
