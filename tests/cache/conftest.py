"""Fixtures for the tuning-DB tests: a fresh SQLite file, and a fresh PostgreSQL schema per test.

PostgreSQL comes from $KILNX_TEST_POSTGRES_URL (started by .ci/postgres.sh). In CI (CI=true) a missing
or unreachable server fails the tests; locally an unset variable skips them with the way to run them.
"""

from __future__ import annotations

import os
import uuid

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from kilnx.runtime.device import DeviceInfo

PG_ENV = "KILNX_TEST_POSTGRES_URL"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

H200 = DeviceInfo(name="NVIDIA H200", arch="sm_90", compute_capability=(9, 0), sm_count=132,
                  memory_bytes=141 * 2**30)
A100 = DeviceInfo(name="NVIDIA A100-SXM4-80GB", arch="sm_80", compute_capability=(8, 0), sm_count=108)


@pytest.fixture
def h200() -> DeviceInfo:
    return H200


@pytest.fixture
def a100() -> DeviceInfo:
    return A100


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/tuning.db"


def _postgres_base_url() -> str:
    url = os.environ.get(PG_ENV, "").strip()
    if not url:
        message = (f"{PG_ENV} is not set: run `bash .ci/postgres.sh` and export "
                   f"{PG_ENV}=postgresql+psycopg://kilnx:kilnx@127.0.0.1:5432/kilnx to run the PostgreSQL tests")
        if IN_CI:
            pytest.fail(f"CI=true but {message}", pytrace=False)
        pytest.skip(message)
    return url


@pytest.fixture
def postgres_url() -> str:
    """A URL whose search_path is a schema of its own, dropped after the test: tests never see each
    other's tables, and all processes given the URL (workers, Optuna) land in the same schema."""
    base = _postgres_base_url()
    schema = f"kilnx_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, connect_args={"connect_timeout": 5})
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    except Exception as e:  # noqa: BLE001 - any failure to reach the server is reported the same way
        admin.dispose()
        pytest.fail(f"PostgreSQL at {PG_ENV} is unreachable ({str(e).splitlines()[0]}); "
                    "start it with `bash .ci/postgres.sh`", pytrace=False)
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request) -> str:
    """Run a test once on a SQLite file and once on a PostgreSQL schema."""
    name = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    return request.getfixturevalue(name)
