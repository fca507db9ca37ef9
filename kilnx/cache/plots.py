"""PNG plots of a tuning DB: what tuning bought per kernel and bucket, and how each Optuna study converged."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from kilnx.cache.errors import DBError
from kilnx.cache.result import TunedResult

if TYPE_CHECKING:
    from kilnx.cache.db import TuningDB


def plot_db(db: "TuningDB", out_dir, study_names: list[str] | None = None) -> list[Path]:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DBError(f"cannot create plot directory {out}: {e.strerror or e}.") from None
    valid = [r for r, status in db.all_results() if status == "valid"]
    paths = plot_speedups(valid, out)
    paths += plot_study_histories(db, out, study_names)
    return paths


def plot_speedups(results: list[TunedResult], out: Path) -> list[Path]:
    """One PNG per kernel: speedup of the tuned config over the default, per bucket, one bar per device."""
    from matplotlib.figure import Figure  # object API: no pyplot state, no GUI backend needed

    by_kernel: dict[str, list[TunedResult]] = {}
    for r in results:
        if r.speedup is not None:
            by_kernel.setdefault(r.kernel, []).append(r)
    paths = []
    for kernel, rows in sorted(by_kernel.items()):
        buckets = sorted({r.bucket for r in rows})
        devices = sorted({r.device_key for r in rows})
        width = 0.8 / len(devices)
        fig = Figure(figsize=(max(6.0, 0.7 * len(buckets) + 2), 4.5), layout="constrained")
        ax = fig.add_subplot()
        for d, device in enumerate(devices):
            speed = {r.bucket: r.speedup for r in rows if r.device_key == device}
            xs = [i + d * width - 0.4 + width / 2 for i, b in enumerate(buckets) if b in speed]
            ax.bar(xs, [speed[b] for b in buckets if b in speed], width=width, label=device)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(buckets)), buckets, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("speedup vs default config (×)")
        ax.set_title(f"{kernel}: tuned vs default")
        ax.legend(fontsize=8)
        path = out / f"speedup_{_file_safe(kernel)}.png"
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


def plot_study_histories(db: "TuningDB", out: Path, study_names: list[str] | None) -> list[Path]:
    """One PNG per Optuna study (those named, else all in the DB) with completed trials."""
    import optuna
    from optuna.trial import TrialState

    storage = db.optuna_storage()
    available = optuna.study.get_all_study_names(storage=storage)
    if study_names is None:
        study_names = available
    missing = [name for name in study_names if name not in available]
    if missing:
        raise DBError(f"no Optuna study named {', '.join(missing)} in this DB; it has: "
                      f"{', '.join(available) or 'none'}.")
    paths = []
    import matplotlib.pyplot as plt
    for name in study_names:
        study = optuna.load_study(study_name=name, storage=storage)
        if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            continue
        multi = len(study.directions) > 1
        with warnings.catch_warnings():
            # The matplotlib backend of optuna.visualization is marked experimental; its output is fine.
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            ax = optuna.visualization.matplotlib.plot_optimization_history(
                study, target=(lambda t: t.values[0]) if multi else None,
                target_name="objective 0" if multi else "objective")
        ax.set_title(f"{name}: optimization history")
        fig = ax.figure
        path = out / f"history_{_file_safe(name)}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def _file_safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name).strip("_") or "unnamed"
