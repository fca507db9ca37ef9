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
