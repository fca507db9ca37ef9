"""Runtime config loading: exact bucket, nearest bucket, default; never a stale config."""

from __future__ import annotations

import math
import warnings
from datetime import datetime, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.cache import TunedResult, TuningDB
from kilnx.runtime import dispatch
from kilnx.runtime.dispatch import TunedConfigs, bucket_distance, get_tuned, parse_bucket

from kilnx.runtime.device import DeviceInfo

DEFAULT = {"BLOCK": 16}


@pytest.fixture
def tuned_db(sqlite_url, h200, a100):
    with TuningDB(sqlite_url) as db:
        for bucket, block in [("M=1,N=4096,K=4096", 1), ("M=16,N=4096,K=4096", 16),
                              ("M=256,N=4096,K=4096", 256), ("M=1,N=14336,K=4096", 14)]:
            db.record_result(kernel="matmul", source_hash="cur", device=h200, bucket=bucket,
                             config={"BLOCK": block}, time_s=1e-5)
        db.record_result(kernel="matmul", source_hash="old", device=h200, bucket="M=2,N=4096,K=4096",
                         config={"BLOCK": "old-source"}, time_s=1e-9)
        db.record_result(kernel="matmul", source_hash="cur", device=a100, bucket="M=2,N=4096,K=4096",
                         config={"BLOCK": "other-gpu"}, time_s=1e-9)
        db.record_result(kernel="matmul", source_hash="cur", device=h200, bucket="M=2,N=4096,K=4096",
                         config={"BLOCK": "old-triton"}, time_s=1e-9, versions={"triton": "0.0.1"})
        db.record_result(kernel="norm", source_hash="n", device=h200, bucket="N=4096,dtype=bf16",
                         config={"warps": 8}, time_s=1e-6)
        yield db


@pytest.fixture(autouse=True)
def fresh_process_cache():
    dispatch.reset()
    yield
    dispatch.reset()


def test_parse_and_distance():
    assert parse_bucket("M=1, N=4096,dtype=bf16") == {"M": 1.0, "N": 4096.0, "dtype": "bf16"}
    assert parse_bucket("whatever") is None and parse_bucket("M=1,M=2") is None
    assert bucket_distance(parse_bucket("M=1,N=8"), parse_bucket("M=4,N=2")) == pytest.approx(4.0)
    assert bucket_distance(parse_bucket("M=1,dtype=bf16"), parse_bucket("M=1,dtype=fp16")) == math.inf
    assert bucket_distance(parse_bucket("M=1"), parse_bucket("M=1,N=2")) == math.inf
    assert bucket_distance(parse_bucket("M=0"), parse_bucket("M=1")) == math.inf


def test_exact_nearest_and_default(tuned_db, h200):
    tuned = TunedConfigs.load(h200, tuned_db)
    cfg = lambda bucket, kernel="matmul", h="cur": tuned.config_for(kernel, h, bucket, DEFAULT)  # noqa: E731
    assert cfg("M=16,N=4096,K=4096") == {"BLOCK": 16}
    # Stale rows (old source, other GPU, old triton) at M=2 are never served; M=1 is nearest.
    assert cfg("M=2,N=4096,K=4096") == {"BLOCK": 1}
    assert cfg("M=3,N=4096,K=4096") == {"BLOCK": 1}       # |log2 3| = 1.58 < |log2 3/16| = 2.4
    assert cfg("M=8,N=4096,K=4096") == {"BLOCK": 16}      # 1 < 3
    assert cfg("M=4,N=4096,K=4096") == {"BLOCK": 1}       # tie at 2: stable (lexicographic) choice
    assert cfg("M=1024,N=4096,K=4096") == {"BLOCK": 256}
    assert cfg("M=1,N=16384,K=4096") == {"BLOCK": 14}     # N matters as much as M
    assert cfg("M=1,N=4096") == DEFAULT                   # different fields: not comparable
    assert cfg("N=4096,dtype=fp16", kernel="norm", h="n") == DEFAULT   # non-numeric fields must match
    assert cfg("N=2048,dtype=bf16", kernel="norm", h="n") == {"warps": 8}
    assert cfg("M=16,N=4096,K=4096", h="old") == {"BLOCK": "old-source"}  # its own hash still answers
    assert cfg("M=16,N=4096,K=4096", h="unknown") == DEFAULT
    assert cfg("M=1", kernel="absent") == DEFAULT


def test_returned_configs_are_copies(tuned_db, h200):
    tuned = TunedConfigs.load(h200, tuned_db)
    tuned.config_for("matmul", "cur", "M=1,N=4096,K=4096", DEFAULT)["BLOCK"] = 999
    assert tuned.config_for("matmul", "cur", "M=1,N=4096,K=4096", DEFAULT) == {"BLOCK": 1}
    tuned.config_for("matmul", "cur", "nope", DEFAULT)["BLOCK"] = 999
    assert DEFAULT == {"BLOCK": 16}


def test_coverage_lists_valid_buckets_only(tuned_db, h200, a100):
    coverage = TunedConfigs.load(h200, tuned_db).coverage()
    assert coverage == {"matmul": ["M=1,N=14336,K=4096", "M=1,N=4096,K=4096", "M=16,N=4096,K=4096",
                                   "M=2,N=4096,K=4096", "M=256,N=4096,K=4096"],
                        "norm": ["N=4096,dtype=bf16"]}  # M=2 is the old-source row: same device, same triton
    assert TunedConfigs.load(a100, tuned_db).coverage() == {"matmul": ["M=2,N=4096,K=4096"]}


def test_loads_once_and_does_not_see_later_writes_until_reset(tuned_db, h200, monkeypatch):
    monkeypatch.setenv("KILNX_DB", tuned_db.url)
    first = get_tuned(h200)
    assert get_tuned(h200) is first
    tuned_db.record_result(kernel="new", source_hash="x", device=h200, bucket="M=1", config={"a": 1}, time_s=1.0)
    assert get_tuned(h200).config_for("new", "x", "M=1", {}) == {}
    dispatch.reset()
    assert get_tuned(h200).config_for("new", "x", "M=1", {}) == {"a": 1}


def test_unreachable_db_warns_once_and_falls_back_to_defaults(h200, a100, monkeypatch):
    monkeypatch.setenv("KILNX_DB", "postgresql+psycopg://x@127.0.0.1:1/x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tuned = get_tuned(h200)
        assert tuned.config_for("matmul", "cur", "M=1", DEFAULT) == DEFAULT
        assert get_tuned(h200) is tuned
        get_tuned(a100)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "using default kernel configs" in messages[0]


sizes = st.sampled_from([1, 2, 3, 8, 16, 64, 100, 4096])


@settings(max_examples=60, deadline=None)
@given(stored=st.lists(st.tuples(sizes, sizes, st.sampled_from(["bf16", "fp16"])), min_size=1, max_size=6,
                       unique=True),
       query=st.tuples(sizes, sizes, st.sampled_from(["bf16", "fp16"])))
def test_nearest_bucket_is_a_closest_comparable_one(stored, query):
    h200 = DeviceInfo(name="NVIDIA H200", arch="sm_90")

    def name(m, n, dtype):
        return f"M={m},N={n},dtype={dtype}"

    entries = [("k", "h", name(*b), {"b": name(*b)}) for b in stored]
    chosen = TunedConfigs(h200, entries).config_for("k", "h", name(*query), {"b": None})["b"]
    same_dtype = [b for b in stored if b[2] == query[2]]
    if not same_dtype:
        assert chosen is None
        return
    distance = lambda b: abs(math.log2(b[0] / query[0])) + abs(math.log2(b[1] / query[1]))  # noqa: E731
    best = min(distance(b) for b in same_dtype)
    assert chosen in {name(*b) for b in same_dtype if math.isclose(distance(b), best)}
    if query in stored:
        assert chosen == name(*query)
