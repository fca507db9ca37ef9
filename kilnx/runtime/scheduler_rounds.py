"""The scheduler's speculative rounds (runtime/scheduler.py): a turn where few rows decode checks proposed tokens
instead of running one step.

Why apart: a round is its own policy (when to run one, whose proposer guesses, how a batch of rows' guesses is laid
out for Engine.verify_rows) over the scheduler's rows; the scheduler asks `run` each turn and goes on with a plain
step when it answers False.
"""

from __future__ import annotations

import torch

from kilnx.runtime.request import Request
from kilnx.runtime.speculative import accept


class SpeculativeRounds:
    """Rounds for `engine`'s rows with `proposer` (runtime/speculative.py), and their telemetry."""

    def __init__(self, engine, proposer, speculate_rows: int | None = None):
        engine.check_rewindable()
        self.proposer = proposer
        # rounds run while at most this many rows decode. 1 by default: on an H100 four rows' rounds served 0.63x
        # plain batched steps with a random model's guesses; on the CPU with real text (SmolLM2 repeating a
        # paragraph) 1.15x against 1.06x for rounds of a row alone (bench/results/2026-12-05_*_speculative*_s25.csv);
        # the GPU with real text is not measured. A proposer that forks runs one a request, else one is shared
        self._per_request = proposer.fork() is not None
        # a draft model has one cache, which follows one sequence: its rounds run for a row alone
        self.most_rows = (1 if speculate_rows is None else speculate_rows) if self._per_request else 1
        self._proposing_for: Request | None = None   # the request whose sequence the shared proposer began
        self.drafted = self.accepted = 0             # guesses made, guesses kept

    def run(self, sched) -> bool:
        """A speculative round of `sched`'s rows decoding, where at most `most_rows` do, none is under a grammar, each
        has room for a guess and at least half of them guess something (a round of several rows costs all of them, and
        gains only where rows guess; on an H100, rounds of four rows while any guessed served 0.63x plain). False: the
        turn's decode step runs instead."""
        engine = sched.engine

        def eligible():
            live = [r for r in sched.rows if r is not None and r.wants_step(engine.max_seq)]
            return live if 1 <= len(live) <= self.most_rows and all(r.constraint is None for r in live) else None
        live = eligible()
        if live is not None and all(r.pacing.idle for r in live):
            for r in live:                     # every row owes plain steps: one, pipelined as usual
                r.pacing.ready()
            return False
        if live is not None and sched._pending is not None:     # a round starts from every token on the host
            sched._collect(sched._pending)
            sched._pending = None
            live = eligible()
        if live is None:
            return False
        max_seq = engine.max_seq
        seqs = [r.ids + r.tokens for r in live]    # each one's last token is not in the cache yet: it is fed now
        # at most max_tokens and the context: a round keeps up to k + 1 tokens, and writes k + 1 positions
        k = min([self.proposer.num_draft] + [min(r.params.max_tokens - len(r.tokens) - 1, max_seq - len(s) - 1)
                                            for r, s in zip(live, seqs)])
        if k < 1:
            return False
        drafts = []
        for r, s in zip(live, seqs):           # a row whose guesses were mostly wrong lately guesses nothing
            proposer = self._proposer_of(r, engine)
            drafts.append(proposer.propose(s, k) if r.pacing.ready() else [])
        if 2 * sum(map(bool, drafts)) < max(len(live), 2):   # none, or fewer than half the rows guess:
            return False                       # the round's cost is the rows', its gain the guessing rows'
        if len(live) == 1:
            logits = [engine.verify([seqs[0][-1], *drafts[0]], row=live[0].row, start=len(seqs[0]) - 1)]
        else:
            # rows 0..B-1, n tokens each: a row's last token, its guesses, then padding (positions on from there,
            # logits unread, K/V overwritten before anything reads it); rows not in the round park at the end
            n, B = 1 + max(map(len, drafts)), engine.decode_rows(live[-1].row + 1)
            tokens, positions = torch.zeros(B, n, dtype=torch.long), torch.full((B, n), engine.park)
            for r, s, d in zip(live, seqs, drafts):
                tokens[r.row, :len(d) + 1] = torch.tensor([s[-1], *d])
                positions[r.row] = torch.arange(len(s) - 1, len(s) - 1 + n)
            out = engine.verify_rows(tokens, positions)
            logits = [out[r.row] for r in live]
        sched.steps += 1
        sched.rows_decoded += len(live)
        for req, draft, x in zip(live, drafts, logits):
            kept = accept(req.sampler, x[:len(draft) + 1], draft)
            req.pacing.record(len(draft), len(kept) - 1)
            self.drafted += len(draft)
            self.accepted += len(kept) - 1
            req.fed += len(kept)               # the last token and the kept guesses are in the cache now
            for j, tok in enumerate(kept):
                if sched.rows[req.row] is not req:  # ended (a stop token or string): the rest is dropped
                    break
                sched._accept(req, tok, x[j] if req.logprobs is not None else None)
        return True

    def _proposer_of(self, req: Request, engine):
        """req's proposer, begun on its sequence: its own fork of the scheduler's, or the one shared draft model
        (begun again when it turns to another request)."""
        if self._per_request:
            if req.proposer is None:
                req.proposer = self.proposer.fork()
                req.proposer.begin(engine)
            return req.proposer
        if self._proposing_for is not req:
            self.proposer.begin(engine)
            self._proposing_for = req
        return self.proposer
