"""Engine: chunked prefill and one-token decode steps over a static KV cache.

On CUDA the decode step of each batch bucket (1, 2, 4, ...) is captured once as a CUDA graph with
static input buffers (token ids, positions) and replayed every step: a decode step is hundreds of
small launches, and replaying them from a graph removes the CPU launch cost that otherwise
dominates small-batch decoding. On CPU the first decode step of each batch size records its numba
launches (codegen/launch.py Recorder) and later steps replay them over static inputs: the Python
dispatch of ~270 kernel calls was ~8 ms of a ~27 ms SmolLM2-135M step (KILNX_CPU_REPLAY=0: eager).

A prompt of up to `prefill_graph_max` tokens (512 by default, KILNX_PREFILL_GRAPH_MAX; 0: off) is padded to
the next bucket length (16, 32, 64, then multiples of 64) and its prefill replayed from a graph captured
for that (row, length) at its first use: such a prefill is a few hundred launches of little work each, so
the host's launch loop, not the GPU, set its time to first token. The padding tokens all sit at the cache's
parking slot (runtime/kv_cache.py: one slot past the context, where no real token lives): they write their junk
K/V there, attend to nothing (kernels/attention.py) and leave a recurrent model's state as the prompt made it
(kernels/ssm.py's padding rule). Rows that ride along in a batched step without a token of their own park there
too.

Sequences occupy cache rows; prefill runs one sequence at a time into its row (prompts differ in
length), decode runs all active rows together with per-row positions.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from kilnx.models.errors import ContextLengthError, TokenIdError, UnsupportedArchitectureError
from kilnx.runtime.kv_cache import KVCache, cache_dtype


@dataclass
class _Graph:
    graph: object
    ids: torch.Tensor        # (b, 1) static input; (1, T) for a prefill graph
    positions: torch.Tensor  # (b, 1) static input; (1, T)
    logits: torch.Tensor     # (b, 1, V) static output
    last: torch.Tensor | None = None   # a prefill graph's (1,) index of the prompt's last token


def prefill_bucket(n: int, largest: int) -> int | None:
    """The padded length a graph-replayed prefill of n tokens runs at: 16, 32, 64, then the next multiple
    of 64 (padding costs GPU time, which these prompts have to spare); None above `largest`."""
    t = 16
    while t < min(n, 64):
        t *= 2
    if n > t:
        t = -(-n // 64) * 64
    return t if t <= largest else None


def _buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class Engine:
    def __init__(self, model, *, max_seq: int | None = None, max_batch: int = 1, prefill_chunk: int | None = None,
                 cuda_graphs: bool | None = None, cpu_replay: bool | None = None, kv_cache_dtype: str = "auto"):
        cfg = model.config
        self.model = model
        self.config = cfg
        self.device = model.device
        self.max_seq = min(max_seq or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.max_batch = max_batch
        # On the GPU a prefill chunk is launched kernel by kernel from Python: with 512-token chunks the
        # llama-3.1-8b prefill of 2048 tokens took 320-360 ms for 83 ms of GPU work (H200, torch profiler,
        # bench/profile_prefill.py): the host, not the GPU, set the pace. Larger chunks give each launch
        # four times the work.
        self.prefill_chunk = prefill_chunk or (2048 if self.device.type == "cuda" else 512)
        kv_dtype = cache_dtype(kv_cache_dtype, model.dtype)
        new_cache = getattr(model, "new_cache", None)     # a hybrid model's cache holds its recurrent state too
        self.cache = (new_cache(max_batch, self.max_seq, dtype=kv_dtype, device=self.device, park=True)
                      if new_cache is not None else
                      KVCache.for_model(cfg, max_batch, self.max_seq, dtype=kv_dtype, device=self.device, park=True))
        self.park = self.cache.park     # = max_seq: the slot past the context where tokenless rows and padding go
        # rows carrying recurrent state (models/hybrid.py) take only their next tokens (a prompt's padding parked):
        # no speculative tokens to take back, no prefixes copied between rows
        self.recurrent = bool(getattr(model, "recurrent", False))
        self._rows_run: dict[int, int] = {}    # a decode graph's id -> the rows B of its last step
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and os.environ.get("KILNX_CUDA_GRAPHS", "1") != "0"
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self._graphs: dict[int, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.prefill_graph_max = int(os.environ.get("KILNX_PREFILL_GRAPH_MAX", "512")) if self.cuda_graphs else 0
        self._prefill_graphs: dict[tuple[int, int], _Graph] = {}   # (row, padded length) -> graph
        self.prefill_graph_refused: dict[tuple[int, int], str] = {}  # (row, padded length) -> why it stays eager
        self._aranged = torch.arange(0, device=self.device)           # 0, 1, ...: a prefill graph's positions
        if cpu_replay is None:
            cpu_replay = self.device.type == "cpu" and os.environ.get("KILNX_CPU_REPLAY", "1") != "0"
        self.cpu_replay = bool(cpu_replay) and self.device.type == "cpu"
        self._replays: dict[int, _Graph | None] = {}   # batch size -> recorded step (None: refused)
        # (row, tokens) or ("rows", rows, tokens each) -> a speculative check's forward, and why one stays eager
        self._verify: dict[tuple, _Graph] = {}
        self.verify_refused: dict[tuple, str] = {}
        # KILNX_LAZY_GRAPHS=1: capture at the first decode step instead, so a new process's first token
        # does not wait for the decode kernels and the capture. Off: on the H200 it moved llama-3.1-8b's first
        # token only 0.13 s (1.19 s from the loaded model against 1.32 s; 3.79 s against 3.52 s in all, the
        # rest the spread of torch's import, bench/results/2026-12-03_h200_cold_s7*.csv), since the prefill
        # loads most of the same kernels, and the second token then waits ~1 s for the capture
        if self.cuda_graphs and os.environ.get("KILNX_LAZY_GRAPHS", "0") != "1":
            self._capture_all()

    # ------------------------------------------------------------------ limits
    def check_fits(self, prompt_len: int) -> None:
        if prompt_len < 1:
            raise ContextLengthError("the prompt is empty; give at least one token.")
        if prompt_len >= self.max_seq:
            raise ContextLengthError(
                f"prompt has {prompt_len} tokens but the context holds {self.max_seq} "
                f"(model maximum {self.config.max_position_embeddings}); shorten the prompt.")

    def check_ids(self, ids: torch.Tensor) -> None:
        """A prompt's ids inside the vocabulary: the embedding lookup kernels do not bounds-check a token id (on the
        CPU one past the table faulted the process)."""
        if not ids.numel():
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise TokenIdError(f"token id {lo if lo < 0 else hi} lies outside the model's vocabulary [0, {self.config.vocab_size}); "
                               "the ids were made by another tokenizer or model.")

    # ------------------------------------------------------------------ steps
    @torch.no_grad()
    def prefill(self, ids: list[int] | torch.Tensor, row: int = 0, start: int = 0) -> torch.Tensor:
        """Run prompt `ids` into cache row `row` at positions start.. in chunks; logits (V,) of the last token."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        n = ids.numel()
        self.check_fits(start + n)
        self.check_ids(ids)
        ids = ids.to(self.device)
        cache = self.cache.rows(row, row + 1)
        t = prefill_bucket(n, self.prefill_graph_max) if self.prefill_graph_max else None
        if t is not None and (row, t) not in self.prefill_graph_refused:
            return self._prefill_graphed(ids, row, start, t, cache)
        return self._forward_chunks(ids, cache, start, last=-1)[-1][0, -1]

    def _forward_chunks(self, ids: torch.Tensor, cache, start: int, last) -> list[torch.Tensor]:
        """Eager forwards of ids at positions start.. in prefill_chunk pieces: each piece's logits."""
        out = []
        for s in range(0, ids.numel(), self.prefill_chunk):
            e = min(ids.numel(), s + self.prefill_chunk)
            pos = torch.arange(start + s, start + e, device=self.device).unsqueeze(0)
            out.append(self.model.forward(ids[s:e].unsqueeze(0), pos, cache, last=last))
        return out

    @torch.no_grad()
    def prefill_logits(self, ids: list[int] | torch.Tensor, row: int = 0, start: int = 0) -> torch.Tensor:
        """prefill() returning every token's logits (n, V), not the last one's: eager chunks, no graph (a prompt's
        log-probabilities, which a server's echo asks for)."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        self.check_fits(start + ids.numel())
        self.check_ids(ids)
        pieces = self._forward_chunks(ids.to(self.device), self.cache.rows(row, row + 1), start, last=None)
        return torch.cat([p[0] for p in pieces])

    @torch.no_grad()
    def verify(self, ids: list[int] | torch.Tensor, row: int = 0, start: int = 0) -> torch.Tensor:
        """A few tokens `ids` (n,) into row `row` at positions start..: every one's logits (n, V) — a speculative
        round's check (runtime/speculative.py). Such a forward is hundreds of launches of little work, like a
        decode step: from its second use at a (row, n) it replays, as a CUDA graph or the CPU's recorded
        launches; the first runs eagerly (compiling, filling memos) and is then captured. The logits are the
        replay's buffer: read them before the next call."""
        self.check_rewindable()
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(self.device)
        n = ids.numel()
        self.check_fits(start + n)
        return self._check_forward((row, n), ids[None], self._arange(n)[None] + start, self.cache.rows(row, row + 1))[0]

    @torch.no_grad()
    def verify_rows(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows 0..B-1, n tokens each: tokens and positions (B, n) -> every token's logits (B, n, V) — speculative
        rounds of several rows in one forward (a row with nothing to check rides along parked, as in decode).
        Replayed like verify from the second use at a (B, n)."""
        self.check_rewindable()
        B, n = tokens.shape
        if int(positions.max()) > self.park:
            raise ContextLengthError(f"generation reached the context length ({self.max_seq} tokens).")
        cache = self.cache.rows(0, B) if B != self.max_batch else self.cache
        return self._check_forward(("rows", B, n), tokens, positions, cache)

    def check_rewindable(self) -> None:
        """Speculative decoding writes guesses into a row and takes back the rejected ones: a row with recurrent state
        cannot take anything back."""
        if self.recurrent:
            raise UnsupportedArchitectureError(
                f"speculative decoding needs rows that can take back rejected tokens; {self.config.arch}'s recurrent "
                "state cannot. Run it without --draft-model / --prompt-lookup.")

    def _check_forward(self, key: tuple, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Every token's logits of a short forward (ids, positions: (b, n)), eager at its first use at `key`, then
        captured and replayed; what a replay returns is its buffer (read it before the next call)."""
        if key not in self._verify:
            z = {"dtype": torch.long, "device": self.device}
            self._verify[key] = _Graph(None, torch.zeros(ids.shape, **z), torch.zeros(ids.shape, **z), None)
        g = self._verify[key]
        g.ids.copy_(ids)
        g.positions.copy_(positions)
        if g.graph is not None:
            g.graph.replay()
            return g.logits
        logits = self.model.forward(g.ids, g.positions, cache, last=None)
        if (self.cuda_graphs or self.cpu_replay) and key not in self.verify_refused:   # first use: capture it
            graph, out = self._capture_forward(lambda: self.model.forward(g.ids, g.positions, cache, last=None))
            if graph is None:
                self.verify_refused[key] = out
            else:
                g.graph, g.logits = graph, out
        return logits

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, *, max_position: int | None = None) -> torch.Tensor:
        """One step for rows 0..B-1: tokens (B,) at positions (B,) -> logits (B, V). A row at position `park`
        (= max_seq, one past the context) is parked: it writes nothing another row reads, and its logits are junk.
        `max_position`, where the caller knows it, spares reading the positions back from the device (a sync per
        step)."""
        B = tokens.shape[0]
        if (int(positions.max()) if max_position is None else max_position) > self.park:
            raise ContextLengthError(f"generation reached the context length ({self.max_seq} tokens).")
        if self.cuda_graphs:
            graphs = self._captured()
            g = graphs[next(b for b in graphs if b >= B)]
            for src, dst in ((tokens, g.ids[:B, 0]), (positions, g.positions[:B, 0])):
                if src.data_ptr() != dst.data_ptr():     # not already written there (decode_inputs)
                    dst.copy_(src)
            if B < g.ids.shape[0] and self._rows_run.get(id(g)) != B:
                # the bucket's rows past B would rerun their last inputs: their attention would walk that row's
                # history again, and a recurrent state would take the token twice. Parked, they read no key and
                # leave the state, and stay parked while steps keep to B rows (a fill when B changes, not a
                # launch every step).
                g.positions[B:, 0].fill_(self.park)
            self._rows_run[id(g)] = B
            g.graph.replay()
            return g.logits[:B, 0]
        if self.cpu_replay:
            g = self._replays.get(B)
            if g is not None:
                g.ids[:, 0].copy_(tokens)
                g.positions[:, 0].copy_(positions)
                g.graph.replay()
                return g.logits[:, 0]
            if B not in self._replays:
                return self._record(tokens, positions)
        cache = self.cache.rows(0, B) if B != self.max_batch else self.cache
        logits = self.model.forward(tokens.view(B, 1).to(self.device), positions.view(B, 1).to(self.device),
                                    cache, last=-1)
        return logits[:, 0]

    @torch.no_grad()
    def mixed(self, tokens: torch.Tensor, positions: torch.Tensor, chunk: list[int], row: int, start: int):
        """A decode step for rows 0..B-1 (tokens, positions (B,), as decode takes them) and a prompt's chunk
        into row `row` at positions start.. in one forward: each weight read once for both. (decode logits
        (B, V), the chunk's last token's logits (V,)). Eager: no graph or replay (the chunk's length varies).
        Row `row`, parked in the step, writes its junk at the parking slot, past the context."""
        B, C = tokens.shape[0], len(chunk)
        self.check_fits(start + C)
        ids = torch.as_tensor(chunk, dtype=torch.long)
        self.check_ids(ids)
        dev = self.device
        ids = torch.cat([ids.to(dev), tokens.to(dev, torch.long)])
        pos = torch.cat([torch.arange(start, start + C, device=dev), positions.to(dev, torch.long)])
        rows = torch.cat([torch.full((C,), row, device=dev), torch.arange(B, device=dev)])
        picks = torch.cat([torch.arange(C, C + B, device=dev), torch.tensor([C - 1], device=dev)])
        logits = self.model.forward_mixed(ids, pos, rows, self.cache, [(0, row, 1, C), (C, 0, B, 1)], picks)
        return logits[:B], logits[B]

    def decode_rows(self, B: int) -> int:
        """The rows a decode of B rows runs: on a GPU the captured graph's bucket (rows past B recompute with
        whatever inputs they were last given), else B."""
        return next(b for b in self._captured() if b >= B) if self.cuda_graphs else B

    @torch.no_grad()
    def capture_step(self, B: int) -> _Graph | None:
        """A decode step of B rows captured under the kernels' choices of the moment, apart from the engine's own
        graphs: the tuner keeps several side by side and times them interleaved (tuner/step_paths.py). Write its
        `ids` / `positions` (B, 1), `graph.replay()`, read `logits` (B, 1, V). On the GPU a CUDA graph in a pool
        of its own (dropped with it); on the CPU the recorded numba launches; None where those cannot replay."""
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"capture_step: {B} rows; this engine holds 1 to {self.max_batch}")
        if self.device.type == "cuda":
            return self._capture(B, torch.cuda.graph_pool_handle())
        ids = torch.zeros(B, 1, dtype=torch.long, device=self.device)
        pos = torch.full((B, 1), self.park, dtype=torch.long, device=self.device)
        return self._recorded(ids, pos)[0]

    def _prefill_graphed(self, ids: torch.Tensor, row: int, start: int, t: int, cache) -> torch.Tensor:
        """The prompt padded to t tokens, replayed from its (row, t) graph; the first prompt of this length
        runs eagerly (compiling, filling every memo) and its forward is then captured (capture records,
        it does not run: nothing is written). A forward that cannot be captured stays eager for this length."""
        n, key = ids.numel(), (row, t)
        g = self._prefill_graphs.get(key)
        if g is None:
            z = {"dtype": torch.long, "device": self.device}
            g = _Graph(None, torch.zeros(1, t, **z), torch.zeros(1, t, **z), None, torch.zeros(1, **z))
        g.last.fill_(n - 1)
        torch.add(self._arange(t), start, out=g.positions[0])
        g.positions[0, n:].fill_(self.park)   # parked padding: no keys walked, the state stays the prompt's
        g.ids[0, n:].zero_()
        g.ids[0, :n].copy_(ids)
        if g.graph is not None:
            g.graph.replay()
            return g.logits[0, -1].clone()   # the buffer is the next replay's output
        logits = self.model.forward(g.ids, g.positions, cache, last=g.last)
        graph, out = self._capture_forward(lambda: self.model.forward(g.ids, g.positions, cache, last=g.last))
        if graph is None:                  # this length stays eager
            self.prefill_graph_refused[key] = out
        else:
            self._prefill_graphs[key] = _Graph(graph, g.ids, g.positions, out, g.last)
        return logits[0, -1]

    def _capture_forward(self, forward) -> tuple[object, object]:
        """`forward` captured for replay — a CUDA graph (capture records, it does not run) or the CPU's recorded
        numba launches (recording runs it) — and its output buffer: (replayer, output), or (None, why not) where
        an op reads the host or syncs (CUDA) or a launch or torch call cannot be replayed (CPU, _TorchGuard)."""
        if self.cuda_graphs:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._pool):
                    out = forward()
            except RuntimeError as e:
                return None, str(e).splitlines()[0]
            return graph, out
        from kilnx.codegen.numba_launch import Recorder
        rec, guard = Recorder(), _TorchGuard()
        with rec, guard:
            out = forward()
        why = rec.refused + guard.unsafe
        return (None, "; ".join(why)) if why else (rec, out)

    def _arange(self, t: int) -> torch.Tensor:
        if self._aranged.numel() < t:
            self._aranged = torch.arange(max(t, 512), device=self.device)
        return self._aranged[:t]

    def decode_inputs(self, B: int = 1) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The captured B-row step's own input buffers (tokens (B,), positions (B,)), where B is a captured
        bucket; else None. A caller that writes the next step's inputs there, on the device, spares
        decode() two copies per step (the pipelined loop in runtime/generate.py)."""
        g = self._captured().get(B) if self.cuda_graphs else None
        return None if g is None else (g.ids[:, 0], g.positions[:, 0])

    def _captured(self) -> dict:
        """The decode graphs by batch bucket, captured at first use."""
        if not self._graphs:
            self._capture_all()
        return self._graphs

    # ------------------------------------------------------------------ CPU step replay
    def _record(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This step, run eagerly once (compiles, fills every memo) and then again while its launches
        are recorded: both runs compute the same values and write the same K/V. The recording is kept
        for replay unless a launch could not be replayed or a torch call outside the kernels wrote
        data or read it on the host (_TorchGuard); then this batch size stays eager."""
        B = tokens.shape[0]
        step, eager, why = self._recorded(tokens.view(B, 1).to(self.device).clone(),
                                          positions.view(B, 1).to(self.device).clone())
        self._replays[B] = step
        self.replay_refused = [] if step is not None else [why]
        return (step.logits if step is not None else eager)[:, 0]

    def _recorded(self, ids: torch.Tensor, pos: torch.Tensor):
        """(the step over static inputs ids / pos (B, 1) recorded for replay, or None; its eager logits; why not):
        run eagerly first (compiles, fills every memo), then again while recorded, from the same state."""
        B = ids.shape[0]
        cache = self.cache.rows(0, B) if B != self.max_batch else self.cache
        saved = cache.save_state() if self.recurrent else None
        eager = self.model.forward(ids, pos, cache, last=-1)
        if saved is not None:       # the recording runs the step again: from the same state, not one step on
            cache.restore_state(saved)
        rec, out = self._capture_forward(lambda: self.model.forward(ids, pos, cache, last=-1))
        return (_Graph(rec, ids, pos, out), eager, None) if rec is not None else (None, eager, out)

    # ------------------------------------------------------------------ CUDA graphs
    def _capture_all(self) -> None:
        # Warm-up and capture run real steps at the parking slot of each row: the junk K/V they write there is
        # never read (no real token lives there, a parked query attends to nothing), so capturing after
        # prefills (KILNX_LAZY_GRAPHS) is as safe as before them.
        for b in sorted(_buckets(self.max_batch), reverse=True):   # largest first: its pool fits the rest
            self._graphs[b] = self._capture(b, self._pool)
        self._graphs = dict(sorted(self._graphs.items()))

    @torch.no_grad()
    def _capture(self, b: int, pool) -> _Graph:
        ids = torch.zeros(b, 1, dtype=torch.long, device=self.device)
        pos = torch.full((b, 1), self.park, dtype=torch.long, device=self.device)
        cache = self.cache.rows(0, b)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            # warm-up: kernels compile or load, every launch memo fills, the allocator grows (one step does
            # it all; a second was only more launches on a cold start's path)
            self.model.forward(ids, pos, cache, last=-1)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.model.forward(ids, pos, cache, last=-1)
        return _Graph(graph, ids, pos, logits)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _TorchGuard(torch.overrides.TorchFunctionMode):
    """Notes torch calls that make a recorded step unfit for replay: any that writes data (a replay
    reruns only kernels) or reads tensor data on the host (a replay would keep the recorded decision).
    Views are fine, as is anything the kernel launch machinery does itself (output allocation)."""

    VIEWS = {"view", "reshape", "__getitem__", "unsqueeze", "squeeze", "expand", "transpose", "permute", "t",
             "flatten", "select", "narrow", "contiguous", "detach", "view_as", "expand_as", "as_strided"}
    HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"}
    METADATA = {"__get__", "size", "dim", "stride", "data_ptr", "numel", "element_size", "is_contiguous",
                "get_device", "__len__", "storage_offset", "untyped_storage", "__format__", "__hash__"}
    TRUSTED = ("kilnx/codegen/launch.py", "kilnx/dsl/kernel.py", "kilnx/dsl/fusion.py")

    def __init__(self):
        super().__init__()
        self.unsafe: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        if name in self.METADATA or self._trusted():
            return out
        if name in self.VIEWS:
            if not _shares_storage(args[0] if args else None, out):
                self.unsafe.append(f"torch {name} copied data")
        elif name in self.HOST_READS:
            self.unsafe.append(f"a host read of tensor data ({name})")
        else:
            self.unsafe.append(f"torch {name} outside the kernels")
        return out

    def _trusted(self) -> bool:
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_filename.endswith(self.TRUSTED):
                return True
            f = f.f_back
        return False


def _shares_storage(src, out) -> bool:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not isinstance(src, torch.Tensor):
        return False
    base = src.untyped_storage().data_ptr()
    return all(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() == base for o in outs)
