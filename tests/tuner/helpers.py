"""Helpers for tuner tests: run a tune of fake kernels, read a study's trials back."""

from __future__ import annotations

FAKE = "tests.tuner.fake_kernels"


def run_tune(url: str, device, kernels: list[str], *, trials: int | None = None, workers: int = 1,
             budget_s: float = 60.0, trial_timeout_s: float = 5.0, problems: list[dict] | None = None):
    """Tune fake kernels (refs relative to fake_kernels) into the DB at `url`; returns the results."""
    from kilnx.cache import TuningDB
    from kilnx.tuner.budget import Budget
    from kilnx.tuner.session import TargetSpec, plan, tune_session
    from kilnx.tuner.study import TuneSettings
    refs = [f"{FAKE}:{k}" for k in kernels]
    specs = [TargetSpec(r, p) for r in refs for p in problems] if problems else plan(kernels=refs)
    with TuningDB(url) as db:
        return tune_session(device, specs, db, Budget(budget_s, len(specs), trials),
                            TuneSettings(trials=trials, trial_timeout_s=trial_timeout_s, rerank_rounds=3),
                            workers=workers)


def load_trials(url: str, study_name: str):
    import optuna
    from kilnx.cache import TuningDB
    with TuningDB(url) as db:
        return optuna.load_study(study_name=study_name, storage=db.optuna_storage()).get_trials(deepcopy=False)
