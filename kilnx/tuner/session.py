"""A whole tune: which kernel×problem targets, which worker goes on which GPU, and the budget split.

Library entry point (the CLI is a thin layer over it):

    from kilnx.tuner.session import plan, tune_session
    results = tune_session(device, plan(models=["smollm2-135m"]), TuningDB(url), Budget(600, 0), ...)
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Protocol

from kilnx.tuner import refs
from kilnx.tuner.budget import Budget
from kilnx.tuner.study import Target, TargetResult, TuneSettings, study_name, tune_target
from kilnx.tuner.worker import DescribeJob, WorkerPool

# The search gets this share of a target's time; the rest covers the final interleaved re-rank.
_SEARCH_SHARE = 0.85


@dataclass(frozen=True)
class TargetSpec:
    kernel_ref: str
    problem: dict


class Reporter(Protocol):
    def target_started(self, target: Target, index: int, count: int) -> None: ...
    def progress(self, target: Target, evaluated: int, best_s: float | None) -> None: ...
    def target_done(self, result: TargetResult) -> None: ...


class SilentReporter:
    def target_started(self, target, index, count):
        pass

    def progress(self, target, evaluated, best_s):
        pass

    def target_done(self, result):
        pass


def plan(models: list[str] = (), kernels: list[str] = (), gpu: bool = True) -> list[TargetSpec]:
    """Targets from the models' shapes (restricted to `kernels` if given), else the kernels' samples.
    `gpu`: which kernels the runtime calls there (the quantized GEMV differs between GPU and CPU). Kernels tuned
    in a model's decode step (registry.STEP_TUNED; tuner/step_paths.py) are never per-call targets."""
    specs: list[TargetSpec] = []
    step_tuned = refs.step_tuned()
    if models:
        wanted = set(kernels)
        for model in models:
            for kernel_name, problem in refs.problems_for_model(model, gpu=gpu):
                if kernel_name not in step_tuned and (kernel_name in wanted or not wanted):
                    specs.append(TargetSpec(kernel_name, dict(problem)))
    else:
        pairs = [(ref, refs.resolve(ref)) for ref in kernels] if kernels else refs.all_registered()
        for ref, kernel in pairs:
            if kernel.name in step_tuned:
                continue
            for problem in kernel.sample_problems():
                specs.append(TargetSpec(ref, dict(problem)))
    seen, unique = set(), []
    for s in specs:
        key = (s.kernel_ref, tuple(sorted(s.problem.items())))
        if key not in seen:
            seen.add(key)
            unique.append(s)
    return unique


def left_unless_named(models: list[str], gpu: bool = True) -> list[str]:
    """The kernels the models' shapes include that a tune leaves out unless named (registry.STEP_TUNED)."""
    return sorted({k for m in models for k, _ in refs.problems_for_model(m, gpu=gpu)} & refs.step_tuned())


def step_tuned_named(kernels: list[str]) -> list[str]:
    """The kernels among `kernels` (names or module:attr references) tuned in a model's decode step."""
    step_tuned = refs.step_tuned()
    return [k for k in kernels if refs.resolve(k).name in step_tuned]


def worker_placement(device: Any, workers: int) -> tuple[str, list[str | None]]:
    """(torch device inside each worker, CUDA_VISIBLE_DEVICES per worker).

    Worker i goes to the i-th GPU of the same model as `device` (a mixed host never mixes results of
    two GPU models in one study); with one such GPU, or on CPU, all workers share the device.
    """
    if not device.is_cuda:
        return "cpu", [None] * workers
    from kilnx.runtime.device import cuda_info
    import torch
    # torch's cuda:N counts only the GPUs this process may see; name them as the workers' parent does.
    parent_visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]

    def name(i: int) -> str:
        return parent_visible[i] if i < len(parent_visible) else str(i)
    same = [i for i in range(torch.cuda.device_count()) if cuda_info(i).key == device.key]
    if workers > 1 and len(same) > 1:
        return "cuda:0", [name(same[i % len(same)]) for i in range(workers)]
    return "cuda:0", [name(device.index)] * workers


def describe(pool: WorkerPool, specs: list[TargetSpec], timeout_s: float
             ) -> tuple[list[Target], list[TargetResult]]:
    """Resolve buckets and defaults on the device; problems that land in one bucket are tuned once."""
    targets, failed, seen = [], [], set()
    for spec in specs:
        kernel = refs.resolve(spec.kernel_ref)
        out = pool.run(DescribeJob(spec.kernel_ref, spec.problem), timeout_s)
        if not out.ok:
            t = Target(spec.kernel_ref, kernel, spec.problem, bucket=str(spec.problem), default_config={})
            failed.append(TargetResult(t, study_name="", error=f"cannot prepare inputs: {out.error or out.kind}"))
            continue
        info = out.info
        key = (kernel.name, kernel.source_hash, info["bucket"])
        if key in seen:
            continue
        seen.add(key)
        targets.append(Target(spec.kernel_ref, kernel, spec.problem, info["bucket"], info["default_config"],
                              info["seed_configs"]))
    return targets, failed


def tune_session(device: Any, specs: list[TargetSpec], db: Any, budget: Budget, settings: TuneSettings,
                 workers: int = 1, reporter: Reporter | None = None) -> list[TargetResult]:
    """Tune every target in turn on `device`, each with its share of the budget; results go to `db`."""
    reporter = reporter or SilentReporter()
    db.register_device(device)
    from kilnx.cache import DBError
    storage = db.optuna_storage()  # one engine for every study of this session
    inner_device, visible = worker_placement(device, max(1, workers))
    results: list[TargetResult] = []
    with WorkerPool(max(1, workers), inner_device, visible) as pool:
        targets, failed = describe(pool, specs, settings.trial_timeout_s)
        results += failed
        for r in failed:
            reporter.target_done(r)
        for kernel in {id(t.kernel): t.kernel for t in targets}.values():
            db.register_kernel(kernel.name, kernel.source_hash)
        budget.targets = len(targets)
        for i, target in enumerate(targets):
            if i and budget.remaining_s() <= 0:
                # --budget is a deadline: each target times its default and checks its configs whatever its
                # share, so with many targets those fixed costs alone ran a 200 s tune of llama-3.2-1b's 38
                # past 250 s. Targets come most important first (kernels/registry.py); the rest wait for a tune
                # with time left.
                r = TargetResult(target, study_name(target.kernel, device.key, target.bucket),
                                 error="not started: the budget was spent (a tune with more budget reaches it)")
                results.append(r)
                reporter.target_done(r)
                continue
            seconds = budget.next_target_seconds() * _SEARCH_SHARE
            own = dataclasses.replace(settings, seconds=seconds if settings.seconds is None
                                      else min(seconds, settings.seconds))
            reporter.target_started(target, i, len(targets))
            try:
                r = tune_target(db, device, target, pool, own, storage=storage,
                                on_progress=lambda n, best, t=target: reporter.progress(t, n, best))
            except DBError:
                raise  # the DB is unusable: every later target would fail the same way
            except Exception as e:  # noqa: BLE001 - one broken target must not lose the others' results
                r = TargetResult(target, study_name(target.kernel, device.key, target.bucket),
                                 error=f"{type(e).__name__}: {e}")
            budget.finish_target()
            results.append(r)
            reporter.target_done(r)
    return results


def geomean_speedup(results: list[TargetResult]) -> float | None:
    s = [r.speedup for r in results if r.speedup]
    if not s:
        return None
    return math.exp(sum(math.log(x) for x in s) / len(s))
