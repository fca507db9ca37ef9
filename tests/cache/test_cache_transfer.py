"""Export to JSON and import elsewhere: how results for a GPU you don't have travel."""

from __future__ import annotations

import json

import pytest

from kilnx.cache import DBError, TuningDB


def fill(db, device):
    db.record_result(kernel="gemv", source_hash="h1", device=device, bucket="M=1,N=64", config={"B": 64},
                     time_s=2e-5, default_time_s=3e-5, trials=5)
    db.record_result(kernel="gemv", source_hash="h1", device=device, bucket="M=8,N=64", config={"B": [1, 2]},
                     time_s=4e-5, peer_time_s=5e-5)
    db.record_result(kernel="rmsnorm", source_hash="r1", device=device, bucket="N=64,dtype=bf16",
                     config={"warps": 4, "flag": True}, time_s=1e-6)


def test_round_trip_into_a_fresh_db(tmp_path, db_url, h200, a100):
    with TuningDB(f"sqlite:///{tmp_path}/gpu_box.db") as source:
        fill(source, h200)
        fill(source, a100)
        assert source.export_json(tmp_path / "h200.json", device=h200) == 3
        exported = sorted(source.valid_results(h200), key=lambda r: (r.kernel, r.bucket))
    with TuningDB(db_url) as target:
        assert target.import_json(tmp_path / "h200.json") == 3
        imported = sorted(target.valid_results(h200), key=lambda r: (r.kernel, r.bucket))
        assert imported == exported  # every field, timestamps included
        assert target.valid_results(a100) == []
        assert [d.to_dict() for d in target.devices()] == [h200.to_dict()]
        # Importing again changes nothing (same times: nothing is faster).
        assert target.import_json(tmp_path / "h200.json") == 3
        assert sorted(target.valid_results(h200), key=lambda r: (r.kernel, r.bucket)) == exported


def test_import_keeps_the_faster_of_local_and_imported(tmp_path, sqlite_url, h200):
    with TuningDB(sqlite_url) as db:
        fill(db, h200)
        db.export_json(tmp_path / "all.json")
    document = json.loads((tmp_path / "all.json").read_text())
    document["results"][0]["time_s"] = 1e-9          # faster: replaces
    document["results"][0]["config"] = {"B": 999}
    document["results"][1]["time_s"] = 1.0           # slower: ignored
    document["results"][1]["config"] = {"B": -1}
    (tmp_path / "edited.json").write_text(json.dumps(document))
    with TuningDB(sqlite_url) as db:
        db.import_json(tmp_path / "edited.json")
        configs = {r.bucket: r.config for r in db.valid_results(h200)}
    assert configs["M=1,N=64"] == {"B": 999}
    assert configs["M=8,N=64"] == {"B": [1, 2]}


def _malformed_documents(valid: dict):
    def edited(fn):
        doc = json.loads(json.dumps(valid))
        fn(doc)
        return json.dumps(doc)
    yield "truncated", json.dumps(valid)[:-40], "is not valid JSON"
    yield "not kilnx", json.dumps({"hello": 1}), "not a kilnx export"
    yield "bad time", edited(lambda d: d["results"][2].__setitem__("time_s", "fast")), r"results\[2\].time_s"
    yield "unknown device", edited(lambda d: d["results"][1].__setitem__("device_key", "sm_1:x")), "not among"
    yield "missing bucket", edited(lambda d: d["results"][2].pop("bucket")), r"results\[2\].bucket"
    yield "future format", edited(lambda d: d.__setitem__("version", 99)), "export format version 99"


def test_malformed_import_fails_cleanly_and_changes_nothing(tmp_path, db_url, h200, a100):
    with TuningDB(f"sqlite:///{tmp_path}/source.db") as source:
        fill(source, a100)
        source.export_json(tmp_path / "good.json")
    valid = json.loads((tmp_path / "good.json").read_text())
    with TuningDB(db_url) as db:
        fill(db, h200)
        before = db.all_results()
        for name, content, expected in _malformed_documents(valid):
            path = tmp_path / f"{name}.json"
            path.write_text(content)
            with pytest.raises(DBError, match=expected) as info:
                db.import_json(path)
            assert "nothing was imported" in str(info.value) and "\n" not in str(info.value)
            assert db.all_results() == before, name


def test_import_that_fails_inside_the_transaction_rolls_back(tmp_path, sqlite_url, h200, a100):
    with TuningDB(f"sqlite:///{tmp_path}/source.db") as source:
        fill(source, a100)
        source.export_json(tmp_path / "good.json")
    doc = json.loads((tmp_path / "good.json").read_text())
    # Passes file validation, fails at the last row's write (a bucket longer than the column allows
    # is caught by the row validator); the rows before it must not stay behind.
    doc["results"][-1]["bucket"] = "x" * 300
    (tmp_path / "late_failure.json").write_text(json.dumps(doc))
    with TuningDB(sqlite_url) as db:
        fill(db, h200)
        before = db.all_results()
        with pytest.raises(DBError, match="result 2 of the import is invalid.*nothing was imported"):
            db.import_json(tmp_path / "late_failure.json")
        assert db.all_results() == before
        assert [d.key for d in db.devices()] == [h200.key]


def test_missing_file_is_a_clear_error(tmp_path, sqlite_url):
    with TuningDB(sqlite_url) as db, pytest.raises(DBError, match="cannot read"):
        db.import_json(tmp_path / "nope.json")
