"""Four tuner worker processes writing to one DB at once (spawned, as real tuner workers are)."""

from __future__ import annotations

import multiprocessing

from kilnx.cache import TuningDB
from kilnx.runtime.device import DeviceInfo

WORKERS = 4
OWN_RESULTS = 12        # distinct identities per worker: each must land exactly once
SHARED_BUCKETS = 3      # identities every worker writes: one best must survive
DEVICE = DeviceInfo(name="NVIDIA H200", arch="sm_90", compute_capability=(9, 0), sm_count=132)


def shared_time(worker: int, round_: int) -> float:
    # Distinct per (worker, round); the global minimum is worker 3's last round.
    return 1e-3 / (1 + worker * 10 + round_)


def write_results(url: str, worker: int, start, errors) -> None:
    try:
        start.wait(60)  # all workers open the DB (schema creation race included) and write together
        db = TuningDB(url)
        for i in range(OWN_RESULTS):
            db.record_result(kernel="own", source_hash="h", device=DEVICE, bucket=f"w={worker},i={i}",
                             config={"worker": worker, "i": i}, time_s=1e-4)
            for b in range(SHARED_BUCKETS):
                if i % 4 == b:
                    rnd = i // 4
                    db.record_result(kernel="shared", source_hash="h", device=DEVICE, bucket=f"M={b}",
                                     config={"worker": worker, "round": rnd}, time_s=shared_time(worker, rnd))
        db.optuna_storage()  # the tuner opens Optuna's storage on the same DB too
        db.close()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
        errors.put(f"worker {worker}: {type(e).__name__}: {e}")


def run_workers(url: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    start, errors = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [ctx.Process(target=write_results, args=(url, w, start, errors)) for w in range(WORKERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    problems = []
    while not errors.empty():
        problems.append(errors.get())
    assert not alive, "workers hung"
    assert not problems, problems
    assert all(p.exitcode == 0 for p in procs)


def test_four_processes_write_concurrently(db_url):
    run_workers(db_url)
    with TuningDB(db_url) as db:
        results = db.valid_results(DEVICE)
    own = [r for r in results if r.kernel == "own"]
    assert sorted((r.config["worker"], r.config["i"]) for r in own) == [
        (w, i) for w in range(WORKERS) for i in range(OWN_RESULTS)]
    shared = sorted((r for r in results if r.kernel == "shared"), key=lambda r: r.bucket)
    assert [r.bucket for r in shared] == [f"M={b}" for b in range(SHARED_BUCKETS)]
    for r in shared:
        rounds = len(range(int(r.bucket[2:]), OWN_RESULTS, 4))
        assert r.config == {"worker": WORKERS - 1, "round": rounds - 1}
        assert r.time_s == shared_time(WORKERS - 1, rounds - 1)
