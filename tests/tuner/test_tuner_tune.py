"""Whole tunes of fake CPU kernels through worker subprocesses into a SQLite tuning DB."""

from optuna.trial import TrialState

from kilnx.cache import TuningDB
from kilnx.tuner.study import config_key
from tests.tuner.helpers import load_trials, run_tune

BEST = {"BLOCK": 16, "unroll": True}


def test_tune_records_the_best_config_per_bucket(sqlite_url, cpu):
    results = run_tune(sqlite_url, cpu, ["scale_add"])  # two buckets; the 13-config space is exhausted
    assert [r.error for r in results] == ["", ""]
    with TuningDB(sqlite_url) as db:
        stored = {r.bucket: r for r in db.valid_results(cpu)}
    assert set(stored) == {"M=4,N=64", "M=8,N=64"}
    for r in stored.values():
        assert r.kernel == "fake_scale_add" and r.config == BEST
        assert r.default_time_s > 2 * r.time_s  # the default (BLOCK=4, no unroll) costs ~50 us, best ~10
        assert r.peer_time_s is not None and r.trials == 13
    first, second = (load_trials(sqlite_url, r.study_name) for r in results)
    for trials in (first, second):
        assert all(t.state != TrialState.RUNNING for t in trials)
        measured = [config_key(t.params) for t in trials if t.user_attrs.get("outcome") == "ok"]
        assert len(measured) == len(set(measured)) == 13  # every valid config once, no repeats
        # the invalid config (BLOCK=64 with unroll) is pruned before compile, never measured
        assert all(not (t.params["BLOCK"] == 64 and t.params["unroll"]) for t in trials
                   if t.user_attrs.get("outcome") == "ok")
    # default first; the second bucket is warm-started with the first bucket's winner
    assert first[0].params == {"BLOCK": 4, "unroll": False}
    assert BEST in [t.params for t in second[:3]]


def test_failing_configs_are_rejected_and_the_tune_completes(sqlite_url, cpu):
    # One seed per failure mode: compile error, OOM, a worker that exits, a hang past the timeout,
    # wrong numbers, NaN, an output left partly unwritten.
    [r] = run_tune(sqlite_url, cpu, ["faulty"], trials=11, trial_timeout_s=1.5, problems=[{"M": 4, "N": 64}])
    assert r.error == "" and r.config["mode"] == "ok"
    outcome = {t.params["mode"]: t.user_attrs.get("outcome") for t in load_trials(sqlite_url, r.study_name)
               if t.params.get("mode") != "ok" and t.user_attrs.get("outcome") != "duplicate"}
    assert outcome == {"raise": "compile", "oom": "resource", "crash": "crash", "hang": "timeout",
                       "wrong": "wrong", "nan": "wrong", "partial": "wrong"}
    with TuningDB(sqlite_url) as db:
        [stored] = db.valid_results(cpu)
    assert stored.config["mode"] == "ok" and stored.trials == 11


def test_the_default_is_recorded_when_nothing_beats_it(sqlite_url, cpu):
    [r] = run_tune(sqlite_url, cpu, ["default_best"], trials=6, problems=[{"M": 4, "N": 64}])
    assert r.config == BEST and r.time_s == r.default_time_s
    with TuningDB(sqlite_url) as db:
        [stored] = db.valid_results(cpu)
    assert stored.config == BEST and stored.time_s == stored.default_time_s


def test_the_budget_is_a_deadline_targets_past_it_are_not_started(sqlite_url, cpu):
    """Once the budget is spent no further target starts (each would still time its default and check its
    configs, whatever its share): they are reported as not started, and a later tune with budget left
    reaches them."""
    from kilnx.tuner.budget import Budget
    from kilnx.tuner.session import TargetSpec, tune_session
    from kilnx.tuner.study import TuneSettings
    from tests.tuner.helpers import FAKE

    class SpentAfterTheFirst(Budget):   # the clock runs out as the first target finishes
        def remaining_s(self) -> float:
            return 60.0 if self.done == 0 else 0.0

    specs = [TargetSpec(f"{FAKE}:scale_add", {"M": m, "N": 64}) for m in (4, 8, 16)]
    with TuningDB(sqlite_url) as db:
        results = tune_session(cpu, specs, db, SpentAfterTheFirst(60.0, len(specs)),
                               TuneSettings(trials=4, trial_timeout_s=5.0))
        stored = [r.bucket for r in db.valid_results(cpu)]
    assert results[0].error == "" and results[0].config is not None
    assert [r.error.split(":")[0] for r in results[1:]] == ["not started", "not started"]
    assert stored == ["M=4,N=64"]


def test_a_later_target_times_its_kernels_on_configs_recorded_earlier_in_the_tune(sqlite_url, cpu, monkeypatch):
    """One worker tunes a consumer (a route: its time depends on another kernel's tuned config), then that kernel,
    then the consumer again: the second consumer's trials see the config the tune recorded in between."""
    from kilnx.cache import TuningDB
    from kilnx.tuner.budget import Budget
    from kilnx.tuner.session import TargetSpec, tune_session
    from kilnx.tuner.study import TuneSettings
    from tests.tuner.helpers import FAKE
    monkeypatch.setenv("KILNX_DB", sqlite_url)     # what the worker's runtime side reads
    specs = [TargetSpec(f"{FAKE}:consumer", {"M": 2, "N": 64}), TargetSpec(f"{FAKE}:scale_add", {"M": 4, "N": 64}),
             TargetSpec(f"{FAKE}:consumer", {"M": 3, "N": 64})]
    with TuningDB(sqlite_url) as db:
        before, tuned, after = tune_session(cpu, specs, db, Budget(120, 3),
                                            TuneSettings(trial_timeout_s=5.0, rerank_rounds=1), workers=1)
    assert tuned.config == BEST
    assert before.default_time_s > 100e-6 and after.default_time_s < 50e-6   # the consumer spins 200 us, then 10
