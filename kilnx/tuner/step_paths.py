"""qmatmul's kernel per (weight, rows), chosen where the choice counts: in the model's captured decode step.

Why not the tuner's one-call trial: on the H100 two paths that won their one-call trials by 7% and 3.5% (o at 4
rows, down at 2) decoded llama-3.1-8b at 0.98x / 0.95x the untuned rate
(bench/results/2026-12-06_h100_batch_decode_paths_tuned_s33.csv): a call timed alone is not the call a decode step
pays, where each kernel launches in the shadow of the one before it. So here a candidate is timed as the step itself:

- For B rows (each of qmatmul_path.ROWS), the decode step of B rows is captured (a CUDA graph on the GPU, the
  recorded numba launches on the CPU) with every weight on the thresholds' path; the buckets its calls ask for are
  the weights to try, largest first.
- For each weight, one step per path that can serve it is captured with that weight's calls forced onto the path
  and every other choice held (qmatmul_path.trying). Each step's logits are checked against the thresholds' step
  (a path that computes wrong numbers is never timed); then the steps are replayed back to back, as decoding
  replays them, in rounds that rotate their order, and the median per step decides. A path replaces the incumbent
  only where its step is faster by `margin`.
- The paths kept for B rows are timed once more, interleaved, against the thresholds' step; they are stored (as
  qmatmul_path results whose times are step times) only if that step is still faster by the margin.

Stored results hold for their own row count only (qmatmul_path.exact_buckets). Steps decode at position PROMPT of
rows whose caches hold zeros: attention costs what it costs after a PROMPT-token prompt whatever the keys hold.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kilnx.kernels.qmatmul_path import MAX_ROWS, ROWS, qmatmul_path

PROMPT = 128            # the position steps decode at (what kilnx bench's decode rows follow)
MARGIN = 0.01           # a path must make the step this much faster to replace the incumbent
# |logits - thresholds' logits| / |thresholds' logits| of an admitted path. A random-weight 8B model amplifies a
# change of rounding: on the H100 every other path for llama-3.1-8b's qkv (off the fused qkv + rope kernel) gave
# 0.050-0.056; a broken step is off by ~1 (o on qmv_h2 at 16 rows: 1.3, session 34)
TOLERANCE = 0.2


@dataclass
class Tried:
    path: str
    step_s: float | None = None   # median seconds per step with this path (the others held)
    note: str = ""                # why it was not timed; "incumbent"; "kept" (it replaced the incumbent)


@dataclass
class RowsResult:
    """What the trial found for steps of `rows` rows."""
    rows: int
    defaults: dict[str, str] = field(default_factory=dict)    # bucket -> the thresholds' path
    chosen: dict[str, str] = field(default_factory=dict)      # bucket -> a path that beat it in the step
    tried: dict[str, list[Tried]] = field(default_factory=dict)
    step_s: float | None = None           # the step on `chosen` in the last comparison
    default_step_s: float | None = None   # the thresholds' step in the same comparison
    error: str | None = None

    @property
    def kept(self) -> bool:
        """Whether `chosen` is stored: non-empty and still faster than the thresholds' step by the margin."""
        return bool(self.chosen) and self.step_s is not None and self.default_step_s is not None \
            and self.step_s < self.default_step_s * (1 - MARGIN)

    @property
    def speedup(self) -> float | None:
        if self.step_s and self.default_step_s:
            return self.default_step_s / self.step_s
        return None


Progress = Callable[[int, int, int, str], None]   # (rows, steps done, steps planned, what is being tried)


class StepTrial:
    """Captures, checks and times decode steps of one engine under given paths."""

    def __init__(self, engine, *, rounds: int | None = None, reps: int | None = None, seed: int = 0):
        self.engine = engine
        self.cuda = engine.device.type == "cuda"
        self.rounds = rounds or (5 if self.cuda else 3)
        self.reps = reps or (20 if self.cuda else 2)
        self.position = min(PROMPT, engine.max_seq - 1)
        self.seed = seed

    def capture(self, rows: int, paths: dict[str, str]):
        """(step, the trial's notes of the buckets asked) for `rows` rows under `paths`; the step's inputs are
        set, so a replay decodes the same tokens at the same positions every time."""
        with qmatmul_path.trying(paths) as trial:
            step = self.engine.capture_step(rows)
        if step is None:
            raise RuntimeError(f"a decode step of {rows} rows could not be captured for replay on "
                               f"{self.engine.device}")
        ids = torch.randint(0, self.engine.config.vocab_size, (rows,),
                            generator=torch.Generator().manual_seed(self.seed + rows))
        step.ids[:, 0].copy_(ids.to(step.ids.device))
        step.positions[:, 0].fill_(self.position)
        return step, trial.asked

    @staticmethod
    def logits(step) -> torch.Tensor:
        step.graph.replay()
        return step.logits[:, 0].float().clone()

    @staticmethod
    def wrong(logits: torch.Tensor, reference: torch.Tensor) -> str | None:
        """Why these logits are not the reference's (to TOLERANCE), or None."""
        if not torch.isfinite(logits).all():
            return "wrong: non-finite logits"
        err = float((logits - reference).norm() / reference.norm().clamp_min(1e-30))
        return f"wrong: logits off by {err:.2g} (relative)" if not err <= TOLERANCE else None

    def time(self, steps: list) -> list[float]:
        """Median seconds per step of each, from `rounds` rotating passes of `reps` back-to-back replays."""
        samples: list[list[float]] = [[] for _ in steps]
        for r in range(self.rounds):
            for j in range(len(steps)):
                i = (j + r) % len(steps)
                samples[i].append(self._replays(steps[i]))
        return [statistics.median(s) for s in samples]

    def _replays(self, step) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            for _ in range(self.reps):
                step.graph.replay()
            return (time.perf_counter() - t0) / self.reps
        step.graph.replay()             # the first replay after another step's pays for its own start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.reps):
            step.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / self.reps


def tune_rows(trial: StepTrial, rows: int, *, deadline: float = math.inf,
              on_progress: Progress | None = None) -> RowsResult:
    """The trial for steps of `rows` rows (see the module's docstring)."""
    result = RowsResult(rows)
    base, asked = trial.capture(rows, {})
    reference = trial.logits(base)
    result.defaults = {b: c.default for b, c in asked.items() if c.rows == rows}
    order = sorted(result.defaults, key=lambda b: -asked[b].nbytes)
    planned = sum(len(asked[b].serving) - 1 for b in order)
    done = 0
    incumbent = dict(result.defaults)
    for bucket in order:
        tried = result.tried[bucket] = []
        steps, paths = [base], [incumbent[bucket]]
        for path in asked[bucket].serving:
            if path == incumbent[bucket]:
                continue
            if time.monotonic() > deadline:
                tried.append(Tried(path, note="not tried: the budget was spent"))
                continue
            if on_progress:
                on_progress(rows, done, planned, f"{bucket.split(',')[0]} {path}")
            done += 1
            try:
                step, _ = trial.capture(rows, {**incumbent, bucket: path})
            except Exception as e:  # noqa: BLE001 - a path that fails to compile or capture is a failed candidate
                tried.append(Tried(path, note=f"fails: {_first_line(e, 120)}"))
                continue
            why = trial.wrong(trial.logits(step), reference)
            if why:
                tried.append(Tried(path, note=why))
                continue
            steps.append(step)
            paths.append(path)
        if len(steps) > 1:
            times = trial.time(steps)
            best = min(range(len(steps)), key=times.__getitem__)
            replaces = best > 0 and times[best] < times[0] * (1 - MARGIN)
            tried += [Tried(p, t, "incumbent" if i == 0 else "kept" if replaces and i == best else "")
                      for i, (p, t) in enumerate(zip(paths, times))]
            if replaces:
                incumbent[bucket], base = paths[best], steps[best]
        del steps
    result.chosen = {b: p for b, p in incumbent.items() if p != result.defaults[b]}
    if result.chosen:       # the kept paths together against the thresholds' own, interleaved once more
        default_step, _ = trial.capture(rows, {})
        chosen_step, _ = trial.capture(rows, incumbent)
        result.default_step_s, result.step_s = trial.time([default_step, chosen_step])
    return result


def tune_step_paths(engine, rows: tuple[int, ...] = ROWS, *, seconds: float | None = None,
                    on_progress: Progress | None = None, **trial_options) -> list[RowsResult]:
    """The trial for each row count in `rows` (at most the engine's max_batch and qmatmul_path.MAX_ROWS) within
    `seconds`; a row count the budget does not reach is reported, not tried."""
    if any(r > min(engine.max_batch, MAX_ROWS) for r in rows):
        raise ValueError(f"step trial rows {rows}: at most min(max_batch {engine.max_batch}, {MAX_ROWS})")
    deadline = time.monotonic() + seconds if seconds else math.inf
    trial = StepTrial(engine, **trial_options)
    out = []
    for r in rows:
        if time.monotonic() > deadline:
            out.append(RowsResult(r, error="not started: the budget was spent"))
            continue
        try:
            out.append(tune_rows(trial, r, deadline=deadline, on_progress=on_progress))
        except Exception as e:  # noqa: BLE001 - the thresholds' own step failing to capture: reported, rows go on
            out.append(RowsResult(r, error=_first_line(e, 200)))
    return out


def _first_line(e: Exception, limit: int) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:limit]}"


def record(db, device, results: list[RowsResult]) -> int:
    """Store the kept paths of each row count as qmatmul_path results (time: the step's); returns how many.
    Each carries the thresholds' step time as its default, so of two results for one bucket (two runs, or two
    models whose weights share a shape) the DB keeps the larger gain over its own step, not the shorter step."""
    n = 0
    for r in results:
        if not r.kept:
            continue
        trials = sum(len(t) for t in r.tried.values())
        for bucket, path in r.chosen.items():
            db.record_result(kernel=qmatmul_path.name, source_hash=qmatmul_path.source_hash, device=device,
                             bucket=bucket, config={"PATH": path}, time_s=r.step_s, default_time_s=r.default_step_s,
                             trials=trials)
            n += 1
    return n


def tune_model(model: str, device, *, seconds: float | None = None, on_progress: Progress | None = None,
               **trial_options) -> list[RowsResult]:
    """The trial on `model` (a zoo preset: random 4-bit group-64 weights at its real config, the format `kilnx tune`
    assumes for presets; a bundled checkpoint or a path: its own weights) on `device` (a DeviceInfo)."""
    from kilnx.models.loaders import BUNDLED, load_model
    from kilnx.models.presets import PRESETS
    from kilnx.runtime.engine import Engine
    key = model.strip().lower()
    random = key in PRESETS and key not in BUNDLED
    lm = load_model(model, device=device.torch_device, random=random, random_format="q4")
    engine = Engine(lm.model, max_seq=PROMPT + 8, max_batch=MAX_ROWS)
    return tune_step_paths(engine, seconds=seconds, on_progress=on_progress, **trial_options)
