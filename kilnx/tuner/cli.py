"""`kilnx tune`: tune kernels for this device into the tuning DB.

The lead registers it with ``app.command("tune")(tune)``. A device this machine does not have, a bad
budget or an unusable DB print one red line and exit non-zero; no traceback.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Annotated, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kilnx.tuner.budget import Budget, parse_duration

if TYPE_CHECKING:   # the study's module imports Optuna: loaded when `kilnx tune` runs, not for every command
    from kilnx.tuner.study import Target, TargetResult

_out = Console()
_err = Console(stderr=True)


def _fail(message: str, code: int = 1) -> None:
    _err.print(f"[red]error: {escape(message)}[/red]", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def fmt_time(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "—"
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


class RichReporter:
    """One progress line per kernel×bucket: trials done and the best time so far."""

    def __init__(self, progress: Progress, trials: int | None):
        self.bar, self.trials, self.tasks = progress, trials, {}

    def _task(self, target: Target):
        key = id(target)
        if key not in self.tasks:
            label = escape(f"{target.kernel.name} {target.bucket}")
            self.tasks[key] = self.bar.add_task(label, total=self.trials, best="—")
        return self.tasks[key]

    def target_started(self, target, index, count):
        self._task(target)

    def progress(self, target, evaluated, best_s):
        self.bar.update(self._task(target), completed=evaluated, best=fmt_time(best_s))

    def target_done(self, result: TargetResult):
        task = self._task(result.target)
        status = f"[red]{escape(result.error)}[/red]" if result.error else fmt_time(result.time_s)
        self.bar.update(task, completed=result.trials, total=result.trials or 1, best=status)


def results_table(results: list[TargetResult]) -> Table:
    table = Table(title="kilnx tune")
    for col, just in (("kernel", "left"), ("bucket", "left"), ("trials", "right"), ("rejected", "right"),
                      ("tuned", "right"), ("default", "right"), ("speedup", "right"), ("vs peer", "right")):
        table.add_column(col, justify=just, no_wrap=True)
    for r in results:
        table.add_row(escape(r.target.kernel.name), escape(r.target.bucket), str(r.trials),
                      str(sum(r.failures.values())), fmt_time(r.time_s), fmt_time(r.default_time_s),
                      fmt_ratio(r.speedup), fmt_ratio(r.vs_peer))
    return table


CSV_COLUMNS = ["suite", "case", "metric", "value", "peer", "peer_value", "device", "torch", "triton", "commit",
               "date"]


def write_results_csv(path: str, results: list[TargetResult], device_key: str) -> None:
    """One row per kernel×bucket (speedup of the recorded config over the default, both timed in this
    tune) and `tune_geomean_speedup_vs_default` over the buckets that have both times."""
    from kilnx.tuner.session import geomean_speedup
    meta = _meta(device_key)
    rows = []
    for r in results:
        if r.speedup is None:
            continue
        case = f"tune_{r.target.kernel.name}_{r.target.bucket.replace(',', '_')}"
        rows.append({"suite": "tune", "case": case, "metric": "speedup", "value": f"{r.speedup:.4g}",
                     "peer": "default_us", "peer_value": f"{r.default_time_s * 1e6:.4g}", **meta})
        rows.append({"suite": "tune", "case": case, "metric": "tuned_us", "value": f"{r.time_s * 1e6:.4g}",
                     "peer": "config", "peer_value": str(r.config), **meta})
    g = geomean_speedup(results)
    if g:
        rows.append({"suite": "tune", "case": "tune_geomean_speedup_vs_default", "metric": "speedup",
                     "value": f"{g:.4g}", "peer": "buckets", "peer_value": str(sum(1 for r in results if r.speedup)),
                     **meta})
    _append_csv(path, rows)


def _meta(device_key: str) -> dict:
    import datetime
    import os

    import torch
    import triton
    return {"device": device_key, "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("KILNX_COMMIT", ""), "date": datetime.date.today().isoformat()}


def _append_csv(path: str, rows: list[dict]) -> None:
    import csv
    import os
    if not rows:
        return
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, CSV_COLUMNS)
        if new:
            w.writeheader()
        w.writerows(rows)


def result_notes(results: list[TargetResult]) -> list[str]:
    """Lines below the table: errors, why configs were rejected, where the default was kept."""
    notes = []
    for r in results:
        where = f"{r.target.kernel.name} {r.target.bucket}"
        if r.error:
            notes.append(f"{where}: {r.error}")
            continue
        if r.failures:
            notes.append(f"{where}: rejected " + ", ".join(f"{k} {v}" for k, v in sorted(r.failures.items())))
        if r.config is not None and r.speedup is not None and r.speedup <= 1.0:
            notes.append(f"{where}: no config beat the default; the default was recorded")
    return notes


def tune(
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N or sm_XX (must be this machine's).")] = "auto",
    model: Annotated[List[str], typer.Option(help="Tune the kernel shapes this model uses (repeatable).")] = [],
    kernel: Annotated[List[str], typer.Option(help="Kernel name or module:attr (repeatable); with --model, "
                                                   "restricts the model's kernels.")] = [],
    budget: Annotated[str, typer.Option(help="Wall time for the whole tune, e.g. 90s, 10m, 1h.")] = "10m",
    trials: Annotated[Optional[int], typer.Option(help="Max evaluated trials per kernel×bucket.")] = None,
    db: Annotated[Optional[str], typer.Option(metavar="URL", help="Tuning DB URL; default $KILNX_DB or the "
                                                                  "user cache file.")] = None,
    workers: Annotated[int, typer.Option(help="Worker processes on each study (one per GPU if several).")] = 1,
    trial_timeout: Annotated[float, typer.Option(help="Seconds before a trial's worker is killed.")] = 60.0,
    seed: Annotated[int, typer.Option(help="Sampler seed.")] = 0,
    csv_path: Annotated[Optional[str], typer.Option("--csv", metavar="FILE",
                                                    help="Append tuned-vs-default rows per kernel×bucket "
                                                         "and the geomean speedup to this CSV.")] = None,
) -> None:  # noqa: B006 - typer reads the [] defaults; they are never mutated
    """Tune kernels for this device with Optuna and record the best configs in the tuning DB."""
    from kilnx.runtime.device import DeviceError, detect
    try:
        dev = detect(device)
    except DeviceError as e:
        _fail(str(e), code=2)
    try:
        total_s = parse_duration(budget)
    except ValueError as e:
        _fail(f"--budget: {e}", code=2)
    if trials is not None and trials < 1:
        _fail("--trials must be at least 1", code=2)
    if workers < 1:
        _fail("--workers must be at least 1", code=2)

    from kilnx.cache import DBError, TuningDB
    from kilnx.tuner.refs import KernelNotFound
    from kilnx.tuner.session import geomean_speedup, left_unless_named, plan, step_tuned_named, tune_session
    try:
        specs = plan(models=list(model), kernels=list(kernel), gpu=dev.is_cuda)
        in_step = step_tuned_named(list(kernel))
    except KernelNotFound as e:
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 - an unknown model name etc. from the registry: one line
        _fail(f"cannot list what to tune: {type(e).__name__}: {e}")
    if in_step and not model:
        _fail(f"{', '.join(in_step)} is tuned in a model's decode step: name the model with --model")
    if not specs and not in_step:
        _fail("nothing to tune: no kernels or shapes matched --model/--kernel")
    if not kernel and (left := left_unless_named(list(model), gpu=dev.is_cuda)):
        _out.print(f"not tuned unless named with --kernel: {', '.join(left)} (tuned in the model's decode step; "
                   "kilnx/kernels/registry.py STEP_TUNED says why)", highlight=False)

    from kilnx.tuner.study import TuneSettings
    settings = TuneSettings(trials=trials, trial_timeout_s=trial_timeout, seed=seed)
    started = time.monotonic()
    results, steps = [], []
    try:
        with TuningDB(db) as tdb:
            if specs:
                _out.print(f"tuning {len(specs)} problem(s) on {escape(dev.key)} with {workers} worker(s), "
                           f"budget {budget}" + (f", ≤{trials} trials each" if trials else ""), highlight=False)
                columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed} trials"),
                           TextColumn("best {task.fields[best]}"), TimeElapsedColumn())
                with Progress(*columns, console=_out, transient=False) as progress:
                    # with a step tune to follow, the per-call targets get half the budget
                    results = tune_session(dev, specs, tdb, Budget(total_s / (2 if in_step else 1), len(specs)),
                                           settings, workers=workers, reporter=RichReporter(progress, trials))
            if in_step:
                steps = step_tune(list(model), dev, tdb, total_s - (time.monotonic() - started))
    except DBError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail("interrupted; finished trials are kept in the DB and the next tune resumes from them", code=130)
    if results:
        _out.print(results_table(results))
        for line in result_notes(results):
            _out.print(escape(line), highlight=False, soft_wrap=True)
        g = geomean_speedup(results)
        _out.print(f"geomean speedup vs default: {fmt_ratio(g)}" if g else "geomean speedup vs default: —")
    if steps:
        _out.print(step_table(steps))
    if csv_path:
        write_results_csv(csv_path, results, dev.key)
        write_step_csv(csv_path, steps, dev.key)
    if (results or steps) and all(r.error for r in results) and all(r.error for _, r in steps):
        raise typer.Exit(1)


def step_tune(models: list[str], dev, tdb, seconds: float) -> list:
    """qmatmul_path tuned in each model's decode step (tuner/step_paths.py), the time left shared between the models;
    [(model, RowsResult)]."""
    from kilnx.tuner.step_paths import record, tune_model
    out = []
    for i, m in enumerate(models):
        share = max(1.0, seconds / (len(models) - i))
        t0 = time.monotonic()
        _out.print(f"qmatmul_path in {escape(m)}'s decode step on {escape(dev.key)}, {share:.0f} s: each path that "
                   "serves a weight timed as the step it runs in", highlight=False)
        columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                   TimeElapsedColumn())
        with Progress(*columns, console=_out, transient=False) as progress:
            task = progress.add_task(f"{escape(m)}: loading", total=None)

            def on_progress(rows, done, planned, what, task=task):
                progress.update(task, description=escape(f"{m} B={rows}: {what}"), completed=done, total=planned)
            try:
                found = tune_model(m, dev, seconds=share, on_progress=on_progress)
            except Exception as e:  # noqa: BLE001 - a model that cannot load or capture: one line, the rest go on
                from kilnx.tuner.step_paths import RowsResult
                found = [RowsResult(0, error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")]
        stored = record(tdb, dev, found)
        _out.print(f"{escape(m)}: {stored} path(s) stored", highlight=False)
        out += [(m, r) for r in found]
        seconds -= time.monotonic() - t0
    return out


def step_table(steps: list) -> Table:
    table = Table(title="qmatmul_path in the decode step")
    for col, just in (("model", "left"), ("rows", "right"), ("paths kept", "left"), ("step", "right"),
                      ("thresholds' step", "right"), ("speedup", "right"), ("stored", "left")):
        table.add_column(col, justify=just, no_wrap=True)
    for m, r in steps:
        kept = "; ".join(f"{b.split(',')[0]} {r.defaults[b]}→{p}" for b, p in r.chosen.items()) or "none"
        table.add_row(escape(m), str(r.rows), escape(r.error or kept), fmt_time(r.step_s), fmt_time(r.default_step_s),
                      fmt_ratio(r.speedup), "yes" if r.kept else "no")
    return table


def write_step_csv(path: str, steps: list, device_key: str) -> None:
    """Per model and row count: the kept paths' step against the thresholds' (`speedup`; 1 where no path was kept),
    and each kept path."""
    meta, rows = _meta(device_key), []
    for m, r in steps:
        case = f"tune_step_qmatmul_path_{m}_B{r.rows}"
        if r.speedup is not None:
            found = [("speedup", f"{r.speedup:.4g}", "default_step_us", f"{r.default_step_s * 1e6:.4g}")]
            found += [(f"path_{b.split(',')[0]}", p, "default", r.defaults[b]) for b, p in r.chosen.items()]
        else:
            found = [] if r.error else [("speedup", "1", "paths_kept", "0")]
        rows += [{"suite": "tune", "case": case, "metric": a, "value": v, "peer": c, "peer_value": d, **meta}
                 for a, v, c, d in found]
        for bucket, tried in r.tried.items():   # per weight: the incumbent's step, the best other, the untimed
            weight = f"{case}_{bucket.split(',')[0]}"
            timed = [t for t in tried if t.step_s is not None]
            first = next((t for t in timed if t.note == "incumbent"), None)
            others = [t for t in timed if t is not first]
            if first is not None:
                rows.append({"suite": "tune", "case": weight, "metric": "step_us", "value": f"{first.step_s * 1e6:.4g}",
                             "peer": "path", "peer_value": first.path, **meta})
            if first is not None and others:
                best = min(others, key=lambda t: t.step_s)
                rows.append({"suite": "tune", "case": weight, "metric": "best_other_step_ratio",
                             "value": f"{best.step_s / first.step_s:.4g}", "peer": "path", "peer_value": best.path,
                             **meta})
            rows += [{"suite": "tune", "case": weight, "metric": "not_timed", "value": t.path, "peer": "why",
                      "peer_value": t.note, **meta} for t in tried if t.step_s is None]
    _append_csv(path, rows)
