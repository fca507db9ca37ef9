"""Fixtures for tuner tests: fake kernels importable here and in workers, DB URLs, a tune helper.

PostgreSQL comes from $KILNX_TEST_POSTGRES_URL (CI sets it and starts the server); each test gets a
schema of its own. Unset locally, those tests skip; unset or unreachable in CI (CI=true), they fail.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # workers inherit sys.path, so "tests.tuner.fake_kernels:..." resolves there too
    sys.path.insert(0, ROOT)

PG_ENV = "KILNX_TEST_POSTGRES_URL"


@pytest.fixture
def cpu():
    from kilnx.runtime.device import detect
    return detect("cpu")


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/tuning.db"


@pytest.fixture
def postgres_url():
    base = os.environ.get(PG_ENV, "").strip()
    if not base:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but {PG_ENV} is not set")
        pytest.skip(f"{PG_ENV} is not set (run `bash .ci/postgres.sh` and export it to run this test)")
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    schema = f"kilnx_tuner_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, connect_args={"connect_timeout": 5})
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    except Exception as e:  # noqa: BLE001 - unreachable server: one clear failure
        admin.dispose()
        pytest.fail(f"PostgreSQL at ${PG_ENV} is unreachable: {str(e).splitlines()[0]}")
    try:
        yield make_url(base).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
            hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")
