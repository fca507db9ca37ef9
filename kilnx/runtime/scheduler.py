"""Continuous batching: requests share the engine's cache rows and decode together, joining and leaving
between steps.

Why: a one-row decode step reads every weight for one token; B rows read them once for B tokens (llama-3.1-8b
on the H200: 16 rows decode 3.9k tok/s against 525 for one, bench/results/2026-12-05_h200_batch_decode_s21*).
A server that ran its requests one after another would leave that unused.

One thread owns the engine (an Engine is not thread-safe, and its CUDA graphs replay on one stream). Each turn
it gives free cache rows to waiting requests, runs one prefill chunk of the oldest request still prefilling
(the request's first token is sampled from its last chunk), then one decode step over rows 0..B-1, B one past
the highest decoding row: a long prompt delays the others' next token by one chunk a turn, not by its whole
prefill. Rows that are free or still prefilling ride along in that step parked at the cache's parking slot
(runtime/kv_cache.py), one past the context: what they write there nothing reads, and they attend to nothing.

On a GPU the host keeps one step ahead: step n + 1 is enqueued, its rows' input tokens taken on the device from
step n's samples, before the host reads step n's tokens and detokenizes them (KILNX_SERVE_LOOKAHEAD=0: off). A
request that ended at step n (a stop token, a stop string) ran one step more, whose token is dropped and whose
K/V, at its next position, nothing reads.

A freed row keeps what its cache holds (the prompt and the tokens fed back in). A new prompt that begins with
a free row's kept tokens takes that row and prefills only the rest: a chat's next turn re-sends the whole
conversation. A prompt sharing 16 or more leading tokens with a busy row's prompt (a system prompt of
requests arriving together) waits for that row to have written them and gets their K/V copied into its row.
With `prefix_slots`, a row's kept tokens are copied into a PrefixStore (runtime/prefix_store.py) before the row
is given to a request that would overwrite them, and a prompt that begins with a stored sequence gets that
prefix copied back: more conversations than rows keep their histories (least recently used given up first).

With a `proposer` (runtime/speculative.py: prompt lookup or a draft model), a turn where at most `speculate_rows`
rows decode (1 by default) is a speculative round instead of a step: each row's proposer guesses up to k tokens, one
forward over the rows' last tokens and guesses checks them (Engine.verify for a row alone, Engine.verify_rows for
several), and each row keeps the guesses the model agrees with plus one token of its own. Past that many rows a
batched step already reads the weights once for several tokens, and rounds wait (vLLM's
speculative_disable_by_batch_size). A draft model has one cache, so its rounds run for a row alone. A row whose
guesses were mostly wrong lately guesses nothing for a while (speculative.Pacing). Rounds are synchronous (no
lookahead) and skip rows under a grammar, whose guesses the grammar would have to judge first.

Each request samples its own row with its own seeded Sampler, so its tokens are those it would get alone: the
batched logits equal the one-row logits to rounding (tests/runtime/test_engine.py), and greedy tokens are
the same (tests/runtime/test_scheduler.py). Text comes out of the tokenizer's incremental decoder; stop strings
are held back until they can no longer begin, and the text ends before one (OpenAI's meaning of `stop`).
"""

from __future__ import annotations

import collections
import os
import queue
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Iterator

import torch

from kilnx.models.errors import ContextLengthError
from kilnx.runtime.engine import Engine
from kilnx.runtime.prefix_store import PrefixStore, common_prefix
from kilnx.runtime.request import Finished, Listener, Request, TokenLogprob, split_at_stop, token_logprobs
from kilnx.runtime.sampling import Sampler, SamplingParams
from kilnx.runtime.scheduler_rounds import SpeculativeRounds

COPY_MIN = 16
"""Prompt tokens another row must share before its K/V is copied rather than recomputed (a copy is 2 x layers
tensor copies; the threshold is a choice, not measured)."""


@dataclass
class _InFlight:
    """A decode step enqueued: its rows, their sampled tokens (indexed by row) on the device and on the way to
    the host."""
    rows: list[tuple[int, Request]]
    picked: torch.Tensor
    host: torch.Tensor
    ready: object                  # a CUDA event once `host` holds the tokens; None where it already does
    logits: torch.Tensor | None    # kept for log-probabilities (steps with such a row are not looked past)


class Scheduler:
    """Serves requests on `engine` (its max_batch rows) from a thread of its own; close() stops it."""

    def __init__(self, engine: Engine, tokenizer=None, *, stop_token_ids: tuple[int, ...] = (),
                 prefill_chunk: int | None = None, lookahead: int | None = None, prefix_slots: int = 0,
                 proposer=None, speculate_rows: int | None = None):
        self.engine = engine
        # speculative rounds (runtime/scheduler_rounds.py), and their telemetry: guesses made, guesses kept
        self.rounds = SpeculativeRounds(engine, proposer, speculate_rows) if proposer is not None else None
        # a recurrent model's rows continue only their own history (_admit_recurrent): no prefix store
        self.store = (PrefixStore(engine.cache, prefix_slots, min_tokens=COPY_MIN)
                      if prefix_slots and not engine.recurrent else None)
        # a GPU step is enqueued before the host reads the previous step's tokens (their detokenizing, stop
        # checks and events run while it computes); on the CPU kernels run as launched, so nothing overlaps
        if lookahead is None:
            lookahead = int(os.environ.get("KILNX_SERVE_LOOKAHEAD", "1" if engine.device.type == "cuda" else "0"))
        self.lookahead = bool(lookahead)
        self._pending: _InFlight | None = None
        # a chunk, the most the other streams wait for a token: on a GPU one graph-replayed prefill (512 tokens,
        # engine.prefill_graph_max); on the CPU ~0.36 s of SmolLM2-135M (1056 tokens took 3.0 s, serve_load --prefix)
        self.prefill_chunk = prefill_chunk or (512 if engine.device.type == "cuda" else 128)
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.rows: list[Request | None] = [None] * engine.max_batch
        # per row, the tokens whose K/V its cache holds at positions 0.. from the sequence that last used it:
        # a new prompt that begins with them prefills only the rest (a chat's next turn, a shared system prompt)
        self.kept: list[list[int]] = [[] for _ in range(engine.max_batch)]
        self.cached_tokens = 0
        self._released = [0] * engine.max_batch      # per row, when it was last freed (a count of releases)
        self.steps = 0                 # decode steps run, and rows they decoded (busy ones): batching telemetry
        self.rows_decoded = 0
        self._waiting: collections.deque[Request] = collections.deque()
        self._admitted = 0
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kilnx-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the callers' side
    def submit(self, ids: list[int], params: SamplingParams, on_event: Listener, stop: tuple[str, ...] = (), *,
               logprobs: int | None = None, echo: bool = False) -> Request:
        """Queue a request; its events arrive through on_event. With `logprobs` (a count of alternatives), each
        token's TokenLogprob arrives as ("logprobs", [TokenLogprob]) before its text, and with `echo` too those
        of the prompt's tokens (first, as one event a prefill chunk). A prompt that cannot fit the context
        raises ContextLengthError here, before anything is queued."""
        self.engine.check_fits(len(ids))
        params.check_vocab(self.engine.config.vocab_size)
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer, and this model has none.")
        constraint = None
        if params.grammar is not None:     # compiled here, so that a bad grammar is the caller's error
            from kilnx.runtime.structured import GrammarConstraint
            constraint = GrammarConstraint(self.tokenizer, params.grammar, self.engine.config.vocab_size,
                                           self.stop_token_ids)
        req = Request(list(ids), params, tuple(s for s in stop if s), on_event, logprobs=logprobs,
                      echo=echo and logprobs is not None, constraint=constraint)
        with self._cv:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            self._waiting.append(req)
            self._cv.notify()
        return req

    def stream(self, ids: list[int], params: SamplingParams, stop: tuple[str, ...] = ()) -> Iterator[str | Finished]:
        """Text pieces, then Finished: the blocking form of submit()."""
        events: queue.Queue = queue.Queue()
        self.submit(ids, params, lambda kind, payload: events.put((kind, payload)), stop)
        while True:
            kind, payload = events.get()
            if kind == "error":
                raise RuntimeError(payload)
            yield payload
            if kind == "done":
                return

    @property
    def drafted(self) -> int:
        """Speculative guesses made (0 without a proposer)."""
        return self.rounds.drafted if self.rounds is not None else 0

    @property
    def accepted(self) -> int:
        """Speculative guesses kept."""
        return self.rounds.accepted if self.rounds is not None else 0

    @property
    def waiting(self) -> int:
        """Requests queued for a cache row."""
        return len(self._waiting)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ the scheduler's thread
    def _run(self) -> None:
        if self.engine.device.type == "cuda":        # this thread's kernels go to the engine's GPU, not cuda:0
            torch.cuda.set_device(self.engine.device)
        while True:
            with self._cv:
                while not self._closed and not self._waiting and not self._busy() and self._pending is None:
                    self._cv.wait()
                if self._closed:
                    break
                while self._waiting and None in self.rows:
                    req = self._waiting.popleft()
                    if req.cancelled:
                        self._notify(req, "done", Finished("cancelled", len(req.ids), ()))
                        continue
                    self._admit(req)
            try:
                self._turn()
            except Exception:          # a bug below: fail the requests in flight, keep serving the next
                message = traceback.format_exc()
                print(message, file=sys.stderr)
                self._pending = None
                for req in [r for r in self.rows if r is not None]:
                    self._release(req, keep=False)
                    self._notify(req, "error", message.strip().splitlines()[-1])
        for req in [r for r in self.rows if r is not None] + list(self._waiting):
            self._notify(req, "error", "the server is shutting down")

    def _turn(self) -> None:
        """One prefill chunk of the oldest request still prefilling, then one decode step of the rows that
        are decoding: a long prompt delays the others' next token by a chunk at a time, not by its whole
        prefill."""
        for req in [r for r in self.rows if r is not None and r.cancelled]:
            self._finish(req, "cancelled")
        for req in [r for r in self.rows if r is not None and r.copy_from is not None]:
            self._take_copy(req)
        filling = [r for r in self.rows if r is not None and not r.tokens and r.copy_from is None]
        if filling:
            self._prefill_chunk(min(filling, key=lambda r: r.admitted))
        if self.rounds is not None and self.rounds.run(self):
            return
        # a step is looked past only where no row needs its tokens on the host before the next step
        pipelined = self.lookahead and not any(r is not None and (r.logprobs is not None or r.constraint is not None)
                                               for r in self.rows)
        if pipelined:              # step n + 1 is enqueued, then step n's tokens are read and handled
            step = self._enqueue(self._pending)
            if self._pending is not None:
                self._collect(self._pending)
            self._pending = step
        else:
            if self._pending is not None:
                self._collect(self._pending)
                self._pending = None
            step = self._enqueue(None)
            if step is not None:
                self._collect(step)

    def _admit(self, req: Request) -> None:
        """Give req a free row, with as much of its prompt's K/V as some row holds, will hold or the store holds:
        the free row whose kept tokens share the longest prefix with the prompt; or, where a busy row's prompt
        shares a longer one of at least COPY_MIN tokens (a system prompt of requests arriving together), that
        prefix copied into a free row once the busy row has written it (`_take_copy`); or a longer stored
        prefix copied in now; else a free row keeping nothing, or the one freed longest ago. Kept tokens the
        request would overwrite go to the store first. At least the prompt's last token is prefilled again (its logits
        give the first token); echo wants every prompt token's logits, so it reuses nothing."""
        ids, limit = req.ids, 0 if req.echo else len(req.ids) - 1
        free = [i for i, r in enumerate(self.rows) if r is None]
        spare = min(free, key=lambda i: (bool(self.kept[i]), self._released[i]))
        if self.engine.recurrent:
            self._admit_recurrent(req, free, spare, limit)
            return
        row, have = spare, 0
        for i in free:
            n = common_prefix(self.kept[i], ids, limit)
            if n > have:
                row, have = i, n
        source, copy = None, 0
        for r in self.rows:
            n = common_prefix(r.ids, ids, limit) if r is not None else 0
            if n > copy or (n == copy and source is not None and r.prefilled > source.prefilled):
                source, copy = r, n
        slot, stored = self.store.best(ids, limit) if self.store is not None else (None, 0)
        if copy >= max(have + 1, COPY_MIN, stored + 1):
            row, have, slot = spare, 0, None
            req.copy_from, req.copy_len = source, copy
        elif stored >= max(have + 1, COPY_MIN):
            row, have = spare, 0
        else:
            slot = None
        kept = self.kept[row]
        overwritten = self.store is not None and common_prefix(kept, ids, len(kept)) < len(kept)
        if slot is not None:       # the stored prefix in, and the row's kept tokens into the slot it leaves
            self.store.exchange(slot, stored, kept if overwritten else [], self.engine.cache, row)
            have = stored
        elif overwritten:
            self.store.save(kept, self.engine.cache, row)   # what the request will overwrite
        self._seat(req, row, have)
        self._take_copy(req)

    def _admit_recurrent(self, req: Request, free: list[int], spare: int, limit: int) -> None:
        """_admit for rows with recurrent state (a hybrid model): a row's state is its kept tokens' whole history,
        so only a prompt that begins with every one of them continues it (a conversation's next turn); nothing is
        copied between rows or stored."""
        row, have = spare, 0
        for i in free:
            k = self.kept[i]
            if have < len(k) <= limit and req.ids[:len(k)] == k:
                row, have = i, len(k)
        self._seat(req, row, have)

    def _seat(self, req: Request, row: int, have: int) -> None:
        req.row, req.prefilled = row, have
        req.cached = have
        self.cached_tokens += have
        self.kept[row] = []                    # its cache changes from here on
        self.rows[row] = req
        self._admitted += 1
        req.admitted = self._admitted

    def _take_copy(self, req: Request) -> None:
        """Copy the prefix req shares with its source row once the source has prefilled that far; if the source
        left its row first, req prefills the prefix itself."""
        src = req.copy_from
        if src is None:
            return
        if self.rows[src.row] is not src:
            req.copy_from = None
        elif src.prefilled >= req.copy_len and src.copy_from is None:
            self.engine.cache.copy_prefix(src.row, req.row, req.copy_len)
            req.prefilled = req.cached = req.copy_len
            self.cached_tokens += req.copy_len
            req.copy_from = None

    def _busy(self) -> bool:
        return any(r is not None for r in self.rows)

    def _prefill_chunk(self, req: Request) -> None:
        if req.sampler is None:
            req.sampler = Sampler(req.params, device=self.engine.device, ops=self.engine.model.ops)
            req.sampler.start(req.ids, self.engine.config.vocab_size, self.stop_token_ids)
            req.sampler.constraint = req.constraint
            req.decoder = self.tokenizer.stream_decoder() if self.tokenizer is not None else None
            if req.params.max_tokens == 0 and not req.echo:
                self._finish(req, "length")
                return
        start = req.prefilled
        req.prefilled = stop = min(len(req.ids), start + self.prefill_chunk)
        if req.echo:
            logits = self.engine.prefill_logits(req.ids[start:stop], row=req.row, start=start)
            # logits[j] predicts prompt token start + j + 1; the last chunk's last row predicts the first output
            head = [TokenLogprob(req.ids[0], None)] if start == 0 else []
            targets = req.ids[start + 1:stop + 1]
            self._notify(req, "logprobs", head + token_logprobs(logits[:len(targets)], targets, req.logprobs))
            logits = logits[-1]
        else:
            logits = self.engine.prefill(req.ids[start:stop], row=req.row, start=start)
        if stop == len(req.ids):
            if req.params.max_tokens == 0:
                self._finish(req, "length")
                return
            first = req.sampler(logits)
            req.sampler.observe(first)
            self._accept(req, int(first[0]), logits)

    def _enqueue(self, prev: _InFlight | None) -> _InFlight | None:
        """One decode step of the rows that want one (None if none does). A row of `prev`, the step still in
        flight, takes that step's token straight from the device."""
        live = [(i, r) for i, r in enumerate(self.rows) if r is not None and r.wants_step(self.engine.max_seq)]
        if not live:
            return None
        B = self.engine.decode_rows(live[-1][0] + 1)   # every row the step runs gets its inputs from here
        tokens, positions = [0] * B, [self.engine.park] * B   # free and prefilling rows park past the context
        for i, r in live:
            tokens[i], positions[i] = r.tokens[-1], len(r.ids) + r.fed
        dev = self.engine.device
        cuda = dev.type == "cuda"

        def to_device(values):     # from pinned memory, not waiting for the step in flight (a pageable copy may)
            t = torch.tensor(values)
            return t.pin_memory().to(dev, non_blocking=True) if cuda else t
        tok, pos = to_device(tokens), to_device(positions)
        # rows of this step still waiting for their token of the step in flight (a row whose last token is in
        # flight no longer wants a step: this step may run fewer rows than that one)
        wanted = {i for i, _ in live}
        carried = [i for i, r in prev.rows if r.inflight and self.rows[i] is r and i in wanted] if prev else []
        if carried:
            idx = to_device(carried)
            tok[idx] = prev.picked[idx]
        logits = self.engine.decode(tok, pos, max_position=max(positions))
        # greedy rows share one argmax over the step's logits; sampled rows and rows whose logits are shaped
        # (penalties, bias, min_tokens) go through their own samplers (generators, token counts on the device)
        # picked[i]: row i's token (parked rows' entries unused)
        own = [(i, r) for i, r in live if not r.params.greedy or r.params.shapes_logits]
        picked = self._argmax(logits) if len(own) < len(live) else torch.zeros(B, dtype=torch.long, device=dev)
        for i, r in own:
            picked[i:i + 1] = r.sampler(logits[i:i + 1]).reshape(1)
            r.sampler.observe(picked[i:i + 1])
        for _, r in live:
            r.fed += 1
            r.inflight += 1
        ready = None
        if cuda:
            host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True).copy_(picked, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = picked
        keep = logits if any(r.logprobs is not None for _, r in live) else None
        return _InFlight(live, picked, host, ready, keep)

    def _collect(self, step: _InFlight) -> None:
        """Hand each row its token of `step` (rows whose request ended meanwhile drop theirs)."""
        if step.ready is not None:
            step.ready.synchronize()
        self.steps += 1
        self.rows_decoded += len(step.rows)
        tokens = step.host.tolist()
        for i, req in step.rows:
            tok = tokens[i]
            req.inflight -= 1
            if self.rows[i] is req:
                self._accept(req, int(tok), step.logits[i] if step.logits is not None else None)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        ops = self.engine.model.ops
        return (ops.argmax(logits) if ops is not None else torch.argmax(logits, dim=-1)).reshape(-1)

    def _accept(self, req: Request, tok: int, logits: torch.Tensor | None = None) -> None:
        req.tokens.append(tok)
        if req.constraint is not None:
            req.constraint.accept(tok)
        if (tok in self.stop_token_ids or tok in req.params.stop_token_ids) and not req.params.ignore_eos:
            self._finish(req, "stop")         # a stop token is neither text nor a logprobs entry
            return
        if req.logprobs is not None and logits is not None:
            self._notify(req, "logprobs", token_logprobs(logits, [tok], req.logprobs))
        if req.decoder is not None:
            piece = req.decoder.push(tok)
            if piece and self._emit(req, piece):
                return
        if req.constraint is not None and req.constraint.matcher.is_stopped():
            self._finish(req, "stop")          # the grammar is complete: nothing but a stop token could follow
            return
        if req.spent(self.engine.max_seq):
            self._finish(req, "length")

    def _emit(self, req: Request, piece: str) -> bool:
        """Send what of `piece` can be sent; True when a stop string ended the request."""
        safe, req.held, stopped = split_at_stop(req.held + piece, req.stop)
        if safe:
            self._notify(req, "text", safe)
        if stopped:
            self._finish(req, "stop", flush=False)
        return stopped

    def _finish(self, req: Request, reason: str, *, flush: bool = True) -> None:
        if flush and reason != "cancelled" and req.decoder is not None:
            tail = req.held + req.decoder.flush()
            req.held = ""
            safe, _, stopped = split_at_stop(tail, req.stop)
            reason = "stop" if stopped else reason
            if safe:
                self._notify(req, "text", safe)
        self._release(req)
        self._notify(req, "done", Finished(reason, len(req.ids), tuple(req.tokens), req.cached))

    def _release(self, req: Request, *, keep: bool = True) -> None:
        if req.row is not None and self.rows[req.row] is req:
            self.rows[req.row] = None
            # what the row's cache now holds: the prompt as far as prefilled, then every token fed back in (all
            # but the last sampled)
            held = req.ids[:req.prefilled] + (req.tokens[:-1] if req.prefilled == len(req.ids) else [])
            if self.engine.recurrent and req.prefilled == len(req.ids):
                # a state takes every token a step fed, a step enqueued ahead of the request's end included
                held = req.ids + req.tokens[:req.fed]
            self.kept[req.row] = held if keep else []     # every position held lies inside the context
            self._released[req.row] = max(self._released) + 1

    @staticmethod
    def _notify(req: Request, kind: str, payload) -> None:
        try:
            req.on_event(kind, payload)
        except Exception:              # a listener's failure is its own request's, never the batch's
            req.cancelled = True
            traceback.print_exc()


def check_prompt(engine: Engine, n_prompt: int, max_tokens: int | None) -> None:
    """The request-time check a server makes: the prompt fits, and so does an explicit max_tokens."""
    engine.check_fits(n_prompt)
    if max_tokens is not None and n_prompt + max_tokens > engine.max_seq:
        raise ContextLengthError(
            f"the context holds {engine.max_seq} tokens, but {n_prompt + max_tokens} were asked for ({n_prompt} in "
            f"the prompt, {max_tokens} to generate); lower max_tokens or shorten the prompt.")
