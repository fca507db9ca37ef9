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
        return tune_session(device, specs, db, Budget(budget_s, len(specs)),
                            TuneSettings(trials=trials, trial_timeout_s=trial_timeout_s, rerank_rounds=3),
                            workers=workers)


def load_trials(url: str, study_name: str):
    import optuna
    from kilnx.cache import TuningDB
    with TuningDB(url) as db:
        return optuna.load_study(study_name=study_name, storage=db.optuna_storage()).get_trials(deepcopy=False)


def tune_in_subprocess(url: str, kernel: str, *, trials: int | None = None, workers: int = 1,
                       env: dict | None = None, problems: list[dict] | None = None):
    """Start `run_tune` in a new Python process (its own session, so a test can kill the whole group)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = str(Path(__file__).resolve().parents[2])
    code = (
        "import json, sys\n"
        "from kilnx.runtime.device import detect\n"
        "from tests.tuner.helpers import run_tune\n"
        "if __name__ == '__main__':\n"
        f"    rs = run_tune({url!r}, detect('cpu'), [{kernel!r}], trials={trials!r}, workers={workers!r},\n"
        f"                  problems={problems!r})\n"
        "    print(json.dumps([{'config': r.config, 'time_s': r.time_s, 'error': r.error,\n"
        "                       'study': r.study_name} for r in rs]))\n"
    )
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": root}
    return subprocess.Popen([sys.executable, "-c", code], cwd=root, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def evaluations(log_path) -> int:
    """Trials evaluated by workers, from the fake kernels' make_args log (trial seeds < GATE_SEED)."""
    from pathlib import Path

    from kilnx.tuner.worker import GATE_SEED
    p = Path(log_path)
    seeds = [int(x) for x in p.read_text().split()] if p.exists() else []
    return sum(1 for s in seeds if s < GATE_SEED)
