"""One Optuna study per kernel×bucket: search, keep it honest, record the winner.

The study lives in the tuning DB's Optuna storage under a name that carries kernel, source hash,
device and bucket, and is opened with load_if_exists: a tune killed mid-way (even SIGKILL) resumes
from the trials already stored, and several processes or hosts pointed at one DB join one search.

Order of trials: the default config, then the kernel's heuristic seeds, then the best configs of the
nearest buckets already tuned for this kernel, then TPE. Constraints prune before anything compiles.
Failed candidates (compile, resources, wrong numbers, hang, crash) are told as PRUNED with the reason
in a user attribute: TPE ranks pruned trials below every completed one, so it learns to leave failing
regions, whereas FAIL trials would be invisible to it.

The winner is picked by an interleaved re-rank of the top few against the default, in one worker with
nothing else running, and the default is kept unless something beats it there.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import time
import warnings
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable

import optuna
from optuna.trial import TrialState

from kilnx.tuner.worker import Outcome, RerankJob, TrialJob, WorkerPool

optuna.logging.set_verbosity(optuna.logging.WARNING)

_OWNER = f"{socket.gethostname()}:{os.getpid()}"
_SPACE_ENUMERATION_LIMIT = 20_000   # count valid configs exactly up to this many (to stop when exhausted)
_MAX_IDLE_ASKS = 200                # consecutive asks that evaluate nothing new: the search has converged
_NEIGHBOURS = 3                     # buckets whose best configs seed a new bucket
_FINALISTS = 3                      # top configs re-ranked against the default


@dataclass
class Target:
    """A kernel at one problem size, as resolved by a worker on the device."""
    kernel_ref: str
    kernel: Any
    problem: dict
    bucket: str
    default_config: dict
    seed_configs: list[dict] = field(default_factory=list)


@dataclass
class TuneSettings:
    trials: int | None = None          # evaluated trials per kernel×bucket (across every process)
    seconds: float | None = None       # wall time for this target, this process
    trial_timeout_s: float = 60.0
    rerank_rounds: int = 5
    seed: int = 0
    # A challenger must beat the default by this factor in the interleaved re-rank to replace it:
    # closer than that is timing noise, and the default is the config everyone can reproduce.
    min_gain: float = 1.02


@dataclass
class TargetResult:
    target: Target
    study_name: str
    config: dict | None = None
    time_s: float | None = None
    default_time_s: float | None = None
    peer_time_s: float | None = None
    trials: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    error: str = ""

    @property
    def speedup(self) -> float | None:
        if self.time_s and self.default_time_s:
            return self.default_time_s / self.time_s
        return None

    @property
    def vs_peer(self) -> float | None:
        if self.time_s and self.peer_time_s:
            return self.peer_time_s / self.time_s
        return None


def study_name(kernel: Any, device_key: str, bucket: str) -> str:
    return f"{kernel.name}|{kernel.source_hash[:12]}|{device_key}|{bucket}"


def config_key(cfg: dict) -> str:
    return json.dumps(cfg, sort_keys=True, default=str)


# ---------------------------------------------------------------- bucket neighbours (warm start)

def bucket_distance(a: str, b: str) -> float:
    """The runtime's nearest-bucket distance, so warm starts pick the buckets dispatch would."""
    from kilnx.runtime.dispatch import bucket_distance as fields_distance, parse_bucket
    fa, fb = parse_bucket(a), parse_bucket(b)
    if fa is None or fb is None:
        return 0.0 if a == b else math.inf
    return fields_distance(fa, fb)


def neighbour_configs(db: Any, device: Any, kernel: Any, bucket: str, k: int = _NEIGHBOURS) -> list[dict]:
    """Best configs of the k nearest buckets already tuned for this kernel source on this device."""
    try:
        results = db.valid_results(device)
    except Exception:  # noqa: BLE001 - a warm start is a bonus; the tune goes on without it
        return []
    scored = []
    for r in results:
        if getattr(r, "kernel", None) != kernel.name or getattr(r, "source_hash", None) != kernel.source_hash:
            continue
        if r.bucket == bucket:
            scored.append((-1.0, r.config))  # this very bucket, tuned before: try its winner first
            continue
        dist = bucket_distance(bucket, r.bucket)
        if math.isfinite(dist):
            scored.append((dist, r.config))
    scored.sort(key=lambda s: s[0])
    return [dict(cfg) for _, cfg in scored[:k]]


# ---------------------------------------------------------------- the study

def _valid(space: Any, cfg: dict) -> dict | None:
    try:
        return space.validate(cfg)
    except Exception:  # noqa: BLE001 - seeds from older sources may name tunables that are gone
        return None


def valid_configs(space: Any) -> list[dict] | None:
    """Every valid config of a small space (None for a large one)."""
    if space.size() > _SPACE_ENUMERATION_LIMIT:
        return None
    return list(space)


def open_study(storage: Any, name: str, seed: int) -> optuna.Study:
    sampler_seed = (zlib.crc32(name.encode()) + seed) % (2**31)
    probe = optuna.create_study(study_name=name, storage=storage, direction="minimize", load_if_exists=True,
                                sampler=optuna.samplers.TPESampler(seed=sampler_seed))
    # Mix in how far the study has come, so a resumed or second process does not replay the same draws.
    n = len(probe.get_trials(deepcopy=False))
    sampler = optuna.samplers.TPESampler(seed=(sampler_seed + n) % (2**31), multivariate=True,
                                         constant_liar=True, n_startup_trials=8)
    return optuna.load_study(study_name=name, storage=storage, sampler=sampler)


def fail_orphans(study: optuna.Study, storage: Any, trial_timeout_s: float) -> int:
    """Mark RUNNING trials whose process is gone as FAIL (left behind by a killed tune)."""
    host = socket.gethostname()
    too_old = datetime.now() - timedelta(seconds=2 * trial_timeout_s + 120)
    failed = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = str(t.user_attrs.get("owner", ""))
        o_host, _, o_pid = owner.rpartition(":")
        dead = t.datetime_start is not None and t.datetime_start < too_old
        if o_host == host and o_pid.isdigit() and int(o_pid) != os.getpid():
            dead = dead or not _pid_alive(int(o_pid))
        if dead:
            try:  # FrozenTrial exposes its storage id only as _trial_id
                storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
                failed += 1
            except Exception:  # noqa: BLE001 - another process got there first
                pass
    return failed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _evaluated(t) -> bool:
    """Did this trial cost a compile and a measurement? (Not: constraint-pruned, duplicate.)"""
    return t.user_attrs.get("outcome") not in ("constraint", "duplicate")


class _StudyProgress:
    """What the stored trials (of every process on this study) say, re-read once per loop."""

    def __init__(self, study: optuna.Study, n_params: int):
        self.study, self.n_params = study, n_params
        self.refresh()

    def refresh(self) -> None:
        self.evaluated = 0
        self.failures: dict[str, int] = {}
        self.finished_values: dict[str, float | None] = {}   # config -> best time (None: rejected)
        self.running: dict[int, str] = {}                     # trial number -> config, any process
        for t in self.study.get_trials(deepcopy=False):
            if t.state == TrialState.RUNNING:
                if len(t.params) == self.n_params and "outcome" not in t.user_attrs:
                    self.running[t.number] = config_key(t.params)
                continue
            if t.state == TrialState.WAITING or not _evaluated(t):
                continue
            self.evaluated += 1
            key = config_key(t.params)
            if t.state == TrialState.COMPLETE:
                prev = self.finished_values.get(key)
                self.finished_values[key] = t.value if prev is None else min(prev, t.value)
            else:  # PRUNED by the gate or a worker failure, or FAIL: an orphan of a killed tune
                self.finished_values.setdefault(key, None)
                kind = str(t.user_attrs.get("outcome", "orphaned"))
                self.failures[kind] = self.failures.get(kind, 0) + 1

    def best(self) -> float | None:
        vals = [v for v in self.finished_values.values() if v is not None]
        return min(vals) if vals else None

    def top_configs(self, n: int) -> list[tuple[dict, float]]:
        ranked = sorted(((v, k) for k, v in self.finished_values.items() if v is not None))
        return [(json.loads(k), v) for v, k in ranked[:n]]


def run_study(target: Target, storage: Any, device_key: str, pool: WorkerPool, settings: TuneSettings,
              warm_configs: list[dict] = (), on_progress: Callable[[int, float | None], None] | None = None
              ) -> tuple[optuna.Study, _StudyProgress]:
    """Run trials of the target's study until its budget is spent or the space is exhausted.

    Budgets and duplicate checks count every process's trials (finished and running), so several
    processes or hosts on one study share its trial budget instead of each spending all of it.
    """
    kernel, space = target.kernel, target.kernel.space
    name = study_name(kernel, device_key, target.bucket)
    study = open_study(storage, name, settings.seed)
    tpe = study.sampler
    fail_orphans(study, storage, settings.trial_timeout_s)
    # Configs to try before TPE, kept in this process: Optuna's shared WAITING queue (enqueue_trial)
    # can hand one enqueued trial to two processes on SQLite, which has no row locks.
    first: list[dict] = []
    for cfg in [target.default_config, *target.seed_configs, *warm_configs]:
        full = _valid(space, cfg)
        if full is not None and full not in first:
            first.append(full)

    progress = _StudyProgress(study, len(space.params))
    every = valid_configs(space)
    n_valid = None if every is None else len(every)
    rng = random.Random(zlib.crc32(name.encode()) + settings.seed)
    started = time.monotonic()
    in_flight: dict[int, tuple[Any, str]] = {}   # job id -> (optuna trial, config key)
    idle_asks = 0

    def measuring() -> set[str]:
        return set(progress.running.values()) | {key for _, key in in_flight.values()}

    def out_of_budget() -> bool:
        if settings.seconds is not None and time.monotonic() - started >= settings.seconds:
            return True
        running = set(progress.running) | {t.number for t, _ in in_flight.values()}
        if settings.trials is not None and progress.evaluated + len(running) >= settings.trials:
            return True
        if n_valid is not None and len(set(progress.finished_values) | measuring()) >= n_valid:
            return True
        return idle_asks >= _MAX_IDLE_ASKS

    def ask() -> tuple[Any, dict]:
        taken = set(progress.finished_values) | measuring()
        while first and config_key(first[0]) in taken:
            first.pop(0)
        if first:
            with warnings.catch_warnings():  # stable in practice since Optuna 2.4; "experimental" by label
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.sampler = optuna.samplers.PartialFixedSampler(first.pop(0), tpe)
        try:
            # the trial is born owned: a kill between creating a trial and naming its owner would leave a
            # RUNNING trial that no later run can tell is dead. Enqueued with the owner, then taken by ask
            # (should another process take it first, each names itself owner below)
            study.enqueue_trial({}, user_attrs={"owner": _OWNER})
            trial = study.ask()
            return trial, space.suggest(trial)
        finally:
            study.sampler = tpe

    while True:
        while not out_of_budget() and pool.idle_workers():
            trial, cfg = ask()
            key = config_key(cfg)
            _set_attr(trial, "owner", _OWNER)
            if not space.is_valid(cfg):
                _set_attr(trial, "outcome", "constraint")
                _safe_tell(study, trial, state=TrialState.PRUNED)
                idle_asks += 1
                continue
            if key not in progress.finished_values and key not in measuring():
                progress.refresh()  # another process may have just started (or finished) this config
            earlier_elsewhere = any(k == key and n < trial.number for n, k in progress.running.items())
            if key in progress.finished_values or earlier_elsewhere or key in {k for _, k in in_flight.values()}:
                # Measured already, or being measured (by the earlier trial, so of two processes that
                # drew it at once exactly one measures it): repeat what is known instead of spending a
                # trial. A config still running elsewhere is told FAIL, which TPE ignores.
                _set_attr(trial, "outcome", "duplicate")
                known = progress.finished_values.get(key)
                if known is not None:
                    _safe_tell(study, trial, known)
                elif key in progress.finished_values:
                    _safe_tell(study, trial, state=TrialState.PRUNED)
                else:
                    _safe_tell(study, trial, state=TrialState.FAIL)
                idle_asks += 1
                if every is not None and not first:
                    # TPE keeps drawing known configs once a small space is nearly covered: hand the
                    # next ask an unmeasured one instead, so covering the space cannot stall.
                    taken = set(progress.finished_values) | measuring()
                    fresh = [c for c in every if config_key(c) not in taken]
                    if fresh:
                        first.append(rng.choice(fresh))
                continue
            idle_asks = 0
            job = TrialJob(target.kernel_ref, target.problem, cfg, seed=settings.seed * 7919 + trial.number)
            job_id = pool.submit(pool.idle_workers()[0], job, settings.trial_timeout_s)
            in_flight[job_id] = (trial, key)
        if not in_flight and out_of_budget():
            break
        for job_id, out in pool.wait(timeout_s=0.5):
            if job_id in in_flight:
                trial, _ = in_flight.pop(job_id)
                _tell(study, trial, out)
        progress.refresh()
        if on_progress:
            on_progress(progress.evaluated, progress.best())
    return study, progress


def _set_attr(trial: Any, key: str, value: Any) -> None:
    try:
        trial.set_user_attr(key, value)
    except optuna.exceptions.UpdateFinishedTrialError:
        pass  # finished by another process meanwhile (see _safe_tell)


def _safe_tell(study: optuna.Study, trial: Any, *args, **kwargs) -> bool:
    """Tell, unless another process already finished this trial (then its result stands)."""
    try:
        study.tell(trial, *args, **kwargs)
        return True
    except (optuna.exceptions.UpdateFinishedTrialError, ValueError) as e:
        if "finished" in str(e).lower() or "cannot tell" in str(e).lower():
            return False
        raise


def _tell(study: optuna.Study, trial: Any, out: Outcome) -> None:
    if out.ok and out.time_s is not None and math.isfinite(out.time_s) and out.time_s > 0:
        _set_attr(trial, "outcome", "ok")
        if out.max_err is not None:
            _set_attr(trial, "max_err", out.max_err)
        _safe_tell(study, trial, out.time_s)
        return
    _set_attr(trial, "outcome", out.kind or "runtime")
    _set_attr(trial, "error", (out.error or "")[:1000])
    _safe_tell(study, trial, state=TrialState.PRUNED)


def finalize(target: Target, progress: _StudyProgress, pool: WorkerPool, settings: TuneSettings,
             result: TargetResult) -> TargetResult:
    """Re-rank the finalists against the default, interleaved, and pick the winner (default on ties)."""
    progress.refresh()
    result.trials = progress.evaluated
    result.failures = dict(progress.failures)
    top = progress.top_configs(_FINALISTS)
    if not top:
        result.error = ("no config passed the correctness gate" if progress.evaluated or result.failures
                        else "the budget ran out before any trial finished")
        return result
    default = _valid(target.kernel.space, target.default_config) or target.default_config
    dkey = config_key(default)
    default_ok = progress.finished_values.get(dkey) is not None
    finalists = ([default] if default_ok else []) + [c for c, _ in top if config_key(c) != dkey]
    rerank = pool.run(RerankJob(target.kernel_ref, target.problem, finalists, rounds=settings.rerank_rounds),
                      timeout_s=settings.trial_timeout_s * 2)
    if rerank.ok and rerank.times and any(math.isfinite(t) for t in rerank.times):
        times = rerank.times
        result.peer_time_s = rerank.peer_time_s
    else:  # the re-rank itself failed: fall back on the trial measurements
        times = [progress.finished_values.get(config_key(c)) or math.inf for c in finalists]
    best_i = min(range(len(finalists)), key=lambda i: times[i])
    if default_ok:
        result.default_time_s = times[0] if math.isfinite(times[0]) else progress.finished_values[dkey]
        if not math.isfinite(times[best_i]) or times[best_i] * settings.min_gain > times[0]:
            best_i = 0  # never record a config that did not clearly beat the default
    result.config = finalists[best_i]
    result.time_s = times[best_i] if math.isfinite(times[best_i]) else progress.finished_values[
        config_key(finalists[best_i])]
    return result


def record(db: Any, device: Any, target: Target, result: TargetResult) -> None:
    if result.config is None or result.time_s is None:
        return
    try:
        from kilnx.cache.result import current_versions
        versions = current_versions()
    except ImportError:
        versions = None
    db.record_result(kernel=target.kernel.name, source_hash=target.kernel.source_hash, device=device,
                     bucket=target.bucket, config=result.config, time_s=result.time_s,
                     default_time_s=result.default_time_s, peer_time_s=result.peer_time_s,
                     trials=result.trials, versions=versions)


def tune_target(db: Any, device: Any, target: Target, pool: WorkerPool, settings: TuneSettings,
                on_progress: Callable[[int, float | None], None] | None = None, storage: Any = None
                ) -> TargetResult:
    """Search one kernel×bucket, re-rank, and record the winner in the DB."""
    name = study_name(target.kernel, device.key, target.bucket)
    result = TargetResult(target=target, study_name=name)
    warm = neighbour_configs(db, device, target.kernel, target.bucket)
    storage = storage if storage is not None else db.optuna_storage()
    _, progress = run_study(target, storage, device.key, pool, settings, warm, on_progress)
    finalize(target, progress, pool, settings, result)
    record(db, device, target, result)
    return result
