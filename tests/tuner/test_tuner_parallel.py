"""Several worker processes on one study: SQLite file and PostgreSQL; a tune killed and resumed."""

import json
import os
import signal
import time
from collections import Counter

import pytest
from optuna.trial import TrialState

from kilnx.cache import TuningDB
from kilnx.tuner.study import config_key
from tests.tuner.helpers import evaluations, load_trials, run_tune, tune_in_subprocess

BEST = {"BLOCK": 16, "unroll": True}
ONE = [{"M": 4, "N": 64}]


def _measured(trials) -> Counter:
    """How often each config was measured (compiled, checked, timed) according to the study."""
    return Counter(config_key(t.params) for t in trials
                   if t.state != TrialState.FAIL and t.user_attrs.get("outcome") == "ok")


def test_four_workers_on_one_study_record_each_trial_once(db_url, cpu, tmp_path, monkeypatch):
    log = tmp_path / "evals.log"
    monkeypatch.setenv("KILNX_FAKE_EVAL_LOG", str(log))
    [r] = run_tune(db_url, cpu, ["scale_add"], workers=4, problems=ONE)
    trials = load_trials(db_url, r.study_name)
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL) for t in trials)
    measured = _measured(trials)
    assert set(measured.values()) == {1} and len(measured) == 13  # every valid config exactly once
    assert evaluations(log) == 13  # and every evaluation a worker did is in the study, once
    assert r.config == BEST
    with TuningDB(db_url) as db:
        assert [(x.bucket, x.config) for x in db.valid_results(cpu)] == [("M=4,N=64", BEST)]


def test_two_tune_processes_join_one_study(db_url, cpu, tmp_path, monkeypatch):
    # This test process and a second one, 2 workers each: 4 worker processes on one study, as two
    # hosts on one DB would be.
    log = tmp_path / "evals.log"
    monkeypatch.setenv("KILNX_FAKE_EVAL_LOG", str(log))
    other = tune_in_subprocess(db_url, "scale_add", workers=2, problems=ONE)
    [mine] = run_tune(db_url, cpu, ["scale_add"], workers=2, problems=ONE)
    out, err = other.communicate(timeout=120)
    assert other.returncode == 0, err[-2000:]
    theirs = json.loads(out.strip().splitlines()[-1])[0]
    assert theirs["study"] == mine.study_name
    trials = load_trials(db_url, mine.study_name)
    assert len({t.number for t in trials}) == len(trials)
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL) for t in trials)
    measured = _measured(trials)
    assert len(measured) == 13
    # each evaluation recorded once: workers' evaluations == measured trials in the shared study
    assert evaluations(log) == sum(measured.values())
    assert sum(measured.values()) <= 13 + 2  # at most a rare simultaneous draw is measured twice
    assert mine.config == theirs["config"] == BEST
    with TuningDB(db_url) as db:
        assert [(x.bucket, x.config) for x in db.valid_results(cpu)] == [("M=4,N=64", BEST)]


def test_a_tune_killed_with_sigkill_resumes_from_its_trials(sqlite_url, cpu):
    proc = tune_in_subprocess(sqlite_url, "slow", trials=8, problems=ONE)  # 0.3 s per compile
    study = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.3)
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            try:
                from kilnx.tuner.study import study_name
                from tests.tuner.fake_kernels import slow
                study = study_name(slow, cpu.key, "M=4,N=64")
                done = [t for t in load_trials(sqlite_url, study) if t.user_attrs.get("outcome") == "ok"]
            except KeyError:  # the study does not exist yet
                continue
            if len(done) >= 3:
                break
        else:
            pytest.fail("the tune did not get 3 trials done in 60 s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the tune and its workers: their own process group
        proc.wait()
    before = {t.number: (t.params, t.value) for t in load_trials(sqlite_url, study)
              if t.state == TrialState.COMPLETE}
    assert len(before) >= 3

    [r] = run_tune(sqlite_url, cpu, ["slow"], trials=8, problems=ONE)
    after = load_trials(sqlite_url, study)
    assert r.error == "" and r.trials == 8  # the budget counts the killed run's trials too
    assert {t.number: (t.params, t.value) for t in after if t.number in before} == before  # union
    assert not [t for t in after if t.state == TrialState.RUNNING]  # the killed run's trial was failed
    with TuningDB(sqlite_url) as db:
        assert [x.bucket for x in db.valid_results(cpu)] == ["M=4,N=64"]


def test_workers_are_pinned_to_gpus_of_the_same_model(monkeypatch):
    import torch

    from kilnx.runtime import device as devmod
    from kilnx.tuner.session import worker_placement
    h200 = devmod.DeviceInfo(name="NVIDIA H200", arch="sm_90", index=0)
    a100 = devmod.DeviceInfo(name="NVIDIA A100", arch="sm_80")
    models = [h200, a100, h200, h200]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(models))
    monkeypatch.setattr(devmod, "cuda_info", lambda i: models[i])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # this process sees physical GPUs 4-7
    assert worker_placement(h200, 4) == ("cuda:0", ["4", "6", "7", "4"])
    assert worker_placement(devmod.DeviceInfo(name="NVIDIA H200", arch="sm_90", index=2), 1) == ("cuda:0", ["6"])
    assert worker_placement(devmod.cpu_info(), 3) == ("cpu", [None, None, None])


def test_a_worker_that_died_while_idle_fails_one_job_and_is_replaced():
    """A worker process can die between jobs (a crash its last job left behind); the next job sent to
    it fails as a crash instead of ending the tune with a BrokenPipeError, and a new worker takes over."""
    from kilnx.tuner.worker import DescribeJob, WorkerPool
    job = DescribeJob("tests.tuner.fake_kernels:scale_add", {"M": 4, "N": 64})
    with WorkerPool(1, "cpu", threads=1) as pool:
        assert pool.run(job, timeout_s=60).ok
        worker = pool.workers[0]
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.join(timeout=10)
        job_id = pool.submit(worker, job, timeout_s=60)
        assert [(jid, out.kind) for jid, out in pool.wait(5)] == [(job_id, "crash")]
        assert pool.run(job, timeout_s=60).ok
