"""TuningDB: recording, best-keeping, staleness, and the errors a user sees."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import create_engine, text

from kilnx.cache import DBError, TunedResult, TuningDB
from kilnx.cache.models import SCHEMA_VERSION
from kilnx.cache.result import installed_triton_version


def record(db, device, *, kernel="gemv", source_hash="h1", bucket="M=1,N=4096,K=4096", time_s=2e-5, **kw):
    return db.record_result(kernel=kernel, source_hash=source_hash, device=device, bucket=bucket,
                            config=kw.pop("config", {"BLOCK_N": 64}), time_s=time_s, **kw)


def test_record_returns_plain_result_with_current_versions(db_url, h200):
    with TuningDB(db_url) as db:
        r = record(db, h200, default_time_s=4e-5, peer_time_s=3e-5, trials=12)
    assert isinstance(r, TunedResult)
    assert (r.kernel, r.source_hash, r.device_key, r.bucket) == ("gemv", "h1", h200.key, "M=1,N=4096,K=4096")
    assert r.config == {"BLOCK_N": 64} and r.trials == 12
    assert r.speedup == pytest.approx(2.0)
    assert r.triton_version == installed_triton_version()
    assert r.created.tzinfo is not None
    with pytest.raises(Exception):
        r.time_s = 1.0  # frozen


def test_keeps_the_fastest_result_per_identity(db_url, h200):
    with TuningDB(db_url) as db:
        record(db, h200, time_s=2e-5, config={"BLOCK_N": 64})
        after_slower = record(db, h200, time_s=3e-5, config={"BLOCK_N": 32})
        assert after_slower.config == {"BLOCK_N": 64} and after_slower.time_s == 2e-5
        after_faster = record(db, h200, time_s=1e-5, config={"BLOCK_N": 128})
        assert after_faster.config == {"BLOCK_N": 128}
        # Another bucket is another identity.
        record(db, h200, bucket="M=16,N=4096,K=4096", time_s=5e-5)
        results = db.valid_results(h200)
    assert sorted((r.bucket, r.time_s) for r in results) == [("M=1,N=4096,K=4096", 1e-5),
                                                              ("M=16,N=4096,K=4096", 5e-5)]


def test_results_with_their_default_times_keep_the_larger_gain(db_url, h200):
    """Two runs' times do not compare (clocks drift; the step trial's are two models' steps), each gain over the
    default timed in the same run does; a result without a default time compares by time."""
    with TuningDB(db_url) as db:
        record(db, h200, time_s=8e-5, default_time_s=10e-5, config={"PATH": "a"})          # 1.25x
        kept = record(db, h200, time_s=4e-5, default_time_s=4.2e-5, config={"PATH": "b"})   # shorter, 1.05x
        assert kept.config == {"PATH": "a"}
        kept = record(db, h200, time_s=9e-5, default_time_s=18e-5, config={"PATH": "c"})    # longer, 2x
        assert kept.config == {"PATH": "c"} and kept.speedup == pytest.approx(2.0)
        kept = record(db, h200, time_s=8.9e-5, config={"PATH": "d"})                        # no default, shorter
        assert kept.config == {"PATH": "d"}
        kept = record(db, h200, time_s=5e-5, default_time_s=20e-5, config={"PATH": "e"})   # d has no gain to compare
        assert kept.config == {"PATH": "e"}


def test_register_device_and_kernel_are_idempotent(db_url, h200, a100):
    with TuningDB(db_url) as db:
        assert db.register_device(h200) == db.register_device(h200) != db.register_device(a100)
        assert db.register_kernel("gemv", "h1") == db.register_kernel("gemv", "h1") != db.register_kernel("gemv", "h2")
        assert {d.key for d in db.devices()} == {h200.key, a100.key}


def test_stale_rows_are_not_served_and_shown_as_stale(db_url, h200, a100):
    with TuningDB(db_url) as db:
        record(db, h200, source_hash="old")                                  # source changed since
        record(db, h200, source_hash="new")                                  # valid
        record(db, h200, source_hash="new", bucket="M=16,N=4096,K=4096", versions={"triton": "0.0.1"})
        record(db, a100, source_hash="new")                                  # another GPU
        valid = db.valid_results(h200, source_hashes={"gemv": "new"})
        assert [(r.source_hash, r.device_key, r.bucket) for r in valid] == [("new", h200.key, "M=1,N=4096,K=4096")]
        # Without hashes, the device and triton filters still apply.
        assert {r.source_hash for r in db.valid_results(h200)} == {"old", "new"}
        assert db.valid_results(h200, triton_version="0.0.1")[0].bucket == "M=16,N=4096,K=4096"

        status = {(r.source_hash, r.device_key, r.triton_version): s
                  for r, s in db.all_results(h200, source_hashes={"gemv": "new"})}
    installed = installed_triton_version()
    assert status[("new", h200.key, installed)] == "valid"
    assert status[("old", h200.key, installed)].startswith("stale: kernel source changed")
    assert status[("new", h200.key, "0.0.1")] == f"stale: triton 0.0.1, installed {installed}"
    assert status[("new", a100.key, installed)].startswith(f"stale: tuned on {a100.key}")


def test_latest_registered_hash_is_current_when_caller_gives_none(db_url, h200):
    with TuningDB(db_url) as db:
        record(db, h200, source_hash="old")
        db.register_kernel("gemv", "new")
        [(_, status)] = db.all_results()
    assert status == "stale: kernel source changed (old -> new)"


def test_prune_removes_only_stale_results(db_url, h200, a100):
    with TuningDB(db_url) as db:
        record(db, h200, source_hash="old")
        record(db, h200, source_hash="new", bucket="M=2,N=8,K=8")
        record(db, h200, source_hash="new", bucket="M=4,N=8,K=8", versions={"triton": "0.0.1"})
        record(db, a100, source_hash="new")     # other device: kept, it is how tuning travels
        assert db.prune() == 2
        assert sorted((r.device_key, r.bucket) for r, s in db.all_results()) == [
            (a100.key, "M=1,N=4096,K=4096"), (h200.key, "M=2,N=8,K=8")]
        assert db.prune() == 0
        assert db.prune(stale_only=False) == 2
        assert db.all_results() == []


def test_bad_arguments_are_rejected_before_writing(sqlite_url, h200):
    with TuningDB(sqlite_url) as db:
        for bad in ({"time_s": float("nan")}, {"time_s": -1.0}, {"config": {"f": object()}}, {"bucket": ""},
                    {"trials": -1}):
            with pytest.raises(ValueError):
                record(db, h200, **bad)
        assert db.all_results() == []


def test_default_url_from_env_and_user_cache_dir(tmp_path, monkeypatch, h200):
    monkeypatch.setenv("KILNX_DB", f"sqlite:///{tmp_path}/env.db")
    assert TuningDB().url == f"sqlite:///{tmp_path}/env.db"
    monkeypatch.delenv("KILNX_DB")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with TuningDB() as db:
        record(db, h200)
    assert (tmp_path / "xdg" / "kilnx" / "tuning.db").is_file()


def test_schema_version_from_the_future_is_refused(db_url):
    TuningDB(db_url).close()
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE kilnx_schema_version SET version = :v"), {"v": SCHEMA_VERSION + 1})
    engine.dispose()
    with pytest.raises(DBError, match=f"schema version {SCHEMA_VERSION + 1}, newer than this kilnx.*upgrade kilnx"):
        TuningDB(db_url)


def test_corrupt_sqlite_file_gives_one_clear_error_and_is_left_alone(tmp_path):
    path = tmp_path / "tuning.db"
    garbage = os.urandom(8192)
    path.write_bytes(garbage)
    with pytest.raises(DBError) as info:
        TuningDB(f"sqlite:///{path}")
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message and "not a readable SQLite tuning DB" in message and "delete" in message
    assert path.read_bytes() == garbage
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuning.db"]


def test_unreachable_server_gives_one_clear_error():
    with pytest.raises(DBError) as info:
        TuningDB("postgresql+psycopg://x@127.0.0.1:1/x")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("cannot connect to postgresql+psycopg://x@127.0.0.1:1/x")
    assert "start the database server" in message


@pytest.mark.parametrize("url, expected", [
    ("not a url", "is not a database URL"),
    ("mysql://u@h/d", "unsupported database 'mysql'"),
    ("sqlite:////nonexistent-kilnx-dir/sub/t.db", "check that its directory exists"),
])
def test_bad_urls_give_one_clear_error(url, expected):
    with pytest.raises(DBError, match=expected):
        TuningDB(url)


def test_password_is_masked_in_messages():
    with pytest.raises(DBError) as info:
        TuningDB("postgresql+psycopg://u:secret@127.0.0.1:1/x")
    assert "secret" not in str(info.value)


def test_optuna_storage_shares_the_url(db_url):
    import optuna
    with TuningDB(db_url) as db:
        storage = db.optuna_storage()
        study = optuna.create_study(study_name="gemv", storage=storage)
        study.optimize(lambda t: t.suggest_int("x", 0, 8) ** 2, n_trials=3)
        assert optuna.study.get_all_study_names(storage=db.optuna_storage()) == ["gemv"]
        assert db.all_results() == []  # Optuna's tables do not disturb ours
