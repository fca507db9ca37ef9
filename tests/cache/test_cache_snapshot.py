"""The runtime's snapshot of tuned configs: served only while the SQLite file is unchanged, and read
without importing SQLAlchemy (what a starting process saves)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kilnx.cache import TuningDB, snapshot
from kilnx.cache.result import installed_triton_version
from kilnx.runtime import dispatch
from kilnx.runtime.dispatch import get_tuned


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILNX_CACHE_DIR", str(tmp_path / "cache"))
    dispatch.reset()
    yield
    dispatch.reset()


def _record(url, device, kernel, value):
    with TuningDB(url) as db:
        db.record_result(kernel=kernel, source_hash="h", device=device, bucket="M=1", config={"B": value},
                         time_s=1e-5)


def _snapshot_file(url, device):
    return snapshot.Snapshot.of(url, device.key, installed_triton_version()).path


def test_sqlite_urls_only():
    assert snapshot.sqlite_file("sqlite:////tmp/x/tuning.db") == snapshot.sqlite_file("sqlite+pysqlite:////tmp/x/tuning.db")
    assert str(snapshot.sqlite_file("sqlite:////tmp/x/tuning.db?timeout=5")).endswith("x/tuning.db")
    assert snapshot.sqlite_file("sqlite://") is None and snapshot.sqlite_file("sqlite:///:memory:") is None
    assert snapshot.sqlite_file("postgresql+psycopg://u@h:5432/db") is None


def test_first_load_writes_it_and_a_write_to_the_db_makes_it_stale(sqlite_url, h200, monkeypatch):
    monkeypatch.setenv("KILNX_DB", sqlite_url)
    _record(sqlite_url, h200, "k", 1)
    assert get_tuned(h200).config_for("k", "h", "M=1", {}) == {"B": 1}
    saved = json.loads(_snapshot_file(sqlite_url, h200).read_text())
    assert saved["entries"] == [["k", "h", "M=1", {"B": 1}]]
    _record(sqlite_url, h200, "k2", 2)          # a tune writes after the snapshot was taken
    dispatch.reset()
    tuned = get_tuned(h200)
    assert tuned.config_for("k2", "h", "M=1", {}) == {"B": 2} and tuned.config_for("k", "h", "M=1", {}) == {"B": 1}


def test_a_corrupt_snapshot_is_read_past(sqlite_url, h200, monkeypatch):
    monkeypatch.setenv("KILNX_DB", sqlite_url)
    _record(sqlite_url, h200, "k", 1)
    get_tuned(h200)
    path = _snapshot_file(sqlite_url, h200)
    path.write_text('{"format": 1, "stamp": ')
    dispatch.reset()
    assert get_tuned(h200).config_for("k", "h", "M=1", {}) == {"B": 1}
    assert json.loads(path.read_text())["entries"] == [["k", "h", "M=1", {"B": 1}]]   # rewritten


def test_a_snapshot_whose_stamp_matches_is_what_is_served(sqlite_url, h200, monkeypatch):
    # Proof that the file, not the DB, answered: a hand-edited entry under the DB's current stamp.
    monkeypatch.setenv("KILNX_DB", sqlite_url)
    _record(sqlite_url, h200, "k", 1)
    get_tuned(h200)
    path = _snapshot_file(sqlite_url, h200)
    data = json.loads(path.read_text())
    data["entries"][0][3] = {"B": "from-snapshot"}
    path.write_text(json.dumps(data))
    dispatch.reset()
    assert get_tuned(h200).config_for("k", "h", "M=1", {}) == {"B": "from-snapshot"}


def test_a_new_process_serves_it_without_importing_sqlalchemy(sqlite_url, h200, tmp_path):
    _record(sqlite_url, h200, "k", 7)
    env = {**os.environ, "KILNX_DB": sqlite_url, "KILNX_CACHE_DIR": str(tmp_path / "cache")}
    code = ("import sys\n"
            "from kilnx.runtime.device import DeviceInfo\n"
            "from kilnx.runtime.dispatch import get_tuned\n"
            f"cfg = get_tuned(DeviceInfo(name={h200.name!r}, arch={h200.arch!r})).config_for('k', 'h', 'M=1', {{}})\n"
            "print(cfg['B'], 'sqlalchemy' in sys.modules)\n")
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    assert runs[0].stdout.split() == ["7", "True"]     # read the DB, wrote the snapshot
    assert runs[1].stdout.split() == ["7", "False"]    # the snapshot alone
