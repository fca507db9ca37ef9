"""TuningDB: the persistent store of tuned kernel configs (SQLite file or PostgreSQL server).

Every public method runs in its own short transaction and returns plain data (TunedResult), so no ORM
session outlives a call. Writes are single upsert statements that keep the best result per identity (see
_upsert_best), which makes concurrent tuner processes safe without any read-modify-write race.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from sqlalchemy import and_, case, create_engine, delete, event, inspect, not_, or_, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection, Engine, make_url

from kilnx.cache.errors import DBError, display_url, explain
from kilnx.cache.location import default_url
from kilnx.cache.models import SCHEMA_VERSION, Base, DeviceRow, KernelRow, ResultRow, SchemaVersionRow
from kilnx.cache.result import TunedResult, check_time, current_versions, installed_triton_version, utcnow
from kilnx.runtime.device import DeviceInfo

# How long a SQLite writer waits for another process's write lock before giving up. Tuner workers
# write a result every few seconds at most, so contention is short; a generous bound avoids spurious
# "database is locked" failures on a loaded 2-core machine.
SQLITE_BUSY_TIMEOUT_S = 60.0
# Fail fast on an unreachable PostgreSQL server instead of hanging the runtime at start.
PG_CONNECT_TIMEOUT_S = 10
# Key of the PostgreSQL advisory lock that serializes schema creation among processes starting together.
_SCHEMA_LOCK_KEY = 0x6B696C6E78  # "kilnx"

_URL_EXAMPLES = "sqlite:////path/to/tuning.db or postgresql+psycopg://user:password@host:5432/dbname"


class TuningDB:
    """Tuned results keyed by (kernel, source hash, device key, bucket, triton version)."""

    def __init__(self, url: str | None = None):
        self.url = url if url else default_url()
        self._engine = _make_engine(self.url)
        self._is_sqlite = self._engine.dialect.name == "sqlite"
        self._insert = sqlite_dialect.insert if self._is_sqlite else pg_dialect.insert
        try:
            self._ensure_schema()
        except BaseException:
            self._engine.dispose()
            raise

    def __repr__(self) -> str:
        return f"TuningDB({display_url(self.url)!r})"

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> "TuningDB":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- transactions and schema -------------------------------------------------------------------

    @contextmanager
    def _transaction(self, action: str, write: bool = False) -> Iterator[Connection]:
        """One transaction; driver errors become a DBError that says what we were doing."""
        try:
            with self._engine.connect() as conn:
                if write and self._is_sqlite:
                    # Take SQLite's write lock up front (BEGIN IMMEDIATE): a transaction that reads and
                    # then writes could otherwise fail at once with SQLITE_BUSY under concurrent writers
                    # instead of waiting for the busy timeout.
                    conn.execution_options(kilnx_immediate=True)
                with conn.begin():
                    yield conn
        except (sa_exc.SQLAlchemyError, sqlite3.Error) as e:
            raise explain(e, self.url, action) from None

    def _ensure_schema(self) -> None:
        for attempt in range(5):
            try:
                with self._transaction("open the DB") as conn:
                    version = _read_schema_version(conn)
                break
            except DBError as e:
                # SQLite answers "database is locked" at once, without waiting out its busy timeout, to
                # a connection opening the file while another switches it to WAL or recovers its WAL
                # (seen with four workers opening a new DB together); a retry absorbs that race
                if not (self._is_sqlite and "locked" in str(e)) or attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))
        if version == SCHEMA_VERSION:
            return
        self._check_version(version)
        # Tables and the version row are created in one transaction (DDL is transactional in both
        # SQLite and PostgreSQL), so a failure leaves nothing half-written.
        with self._transaction("create the tuning tables", write=True) as conn:
            if not self._is_sqlite:
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
            version = _read_schema_version(conn)  # another process may have created it meanwhile
            self._check_version(version)
            if version is None:
                Base.metadata.create_all(conn)
                conn.execute(self._insert(SchemaVersionRow).values(id=1, version=SCHEMA_VERSION)
                             .on_conflict_do_nothing())

    def _check_version(self, version: int | None) -> None:
        where = display_url(self.url)
        if version is not None and version > SCHEMA_VERSION:
            raise DBError(f"tuning DB {where} has schema version {version}, newer than this kilnx understands "
                          f"({SCHEMA_VERSION}): upgrade kilnx, or pass another --db URL / KILNX_DB.")
        if version is not None and version < SCHEMA_VERSION:
            raise DBError(f"tuning DB {where} has old schema version {version} (this kilnx uses "
                          f"{SCHEMA_VERSION}): export it with the kilnx that wrote it, then start a new DB.")

    # ---- registration ------------------------------------------------------------------------------

    def register_device(self, info: DeviceInfo) -> int:
        with self._transaction("register a device", write=True) as conn:
            return self._upsert_device(conn, info)

    def register_kernel(self, name: str, source_hash: str) -> int:
        _check_identity(kernel=name, source_hash=source_hash)
        with self._transaction("register a kernel", write=True) as conn:
            return self._upsert_kernel(conn, name, source_hash, utcnow())

    def _upsert_device(self, conn: Connection, info: DeviceInfo) -> int:
        ins = self._insert(DeviceRow).values(key=info.key, name=info.name, arch=info.arch,
                                             info=info.to_dict(), updated=utcnow())
        stmt = ins.on_conflict_do_update(
            index_elements=[DeviceRow.key],
            set_={"name": ins.excluded.name, "arch": ins.excluded.arch, "info": ins.excluded.info,
                  "updated": ins.excluded.updated},
        ).returning(DeviceRow.id)
        return conn.execute(stmt).scalar_one()

    def _upsert_kernel(self, conn: Connection, name: str, source_hash: str, seen: datetime) -> int:
        ins = self._insert(KernelRow).values(name=name, source_hash=source_hash, last_seen=seen)
        # last_seen only moves forward: importing old results must not make an old hash look current.
        newer = case((KernelRow.last_seen < ins.excluded.last_seen, ins.excluded.last_seen),
                     else_=KernelRow.last_seen)
        stmt = ins.on_conflict_do_update(index_elements=[KernelRow.name, KernelRow.source_hash],
                                         set_={"last_seen": newer}).returning(KernelRow.id)
        return conn.execute(stmt).scalar_one()

    # ---- writing results ---------------------------------------------------------------------------

    def record_result(self, *, kernel: str, source_hash: str, device: DeviceInfo, bucket: str, config: dict,
                      time_s: float, default_time_s: float | None = None, peer_time_s: float | None = None,
                      trials: int = 0, versions: dict | None = None) -> TunedResult:
        """Store a tuned result unless a better one exists for the same identity (_upsert_best); return the best one."""
        stamp = {**current_versions(), **(versions or {})}
        values = _result_values(kernel=kernel, source_hash=source_hash, bucket=bucket, config=config,
                                time_s=time_s, default_time_s=default_time_s, peer_time_s=peer_time_s,
                                trials=trials, versions=stamp, created=utcnow())
        with self._transaction("record a tuned result", write=True) as conn:
            device_id = self._upsert_device(conn, device)
            kernel_id = self._upsert_kernel(conn, kernel, source_hash, values["created"])
            self._upsert_best(conn, device_id, kernel_id, values)
            row = conn.execute(_RESULT_SELECT.where(
                ResultRow.kernel_id == kernel_id, ResultRow.device_id == device_id,
                ResultRow.bucket == values["bucket"], ResultRow.triton_version == values["triton_version"],
            )).one()
        return _to_result(row)

    def _upsert_best(self, conn: Connection, device_id: int, kernel_id: int, values: dict) -> None:
        ins = self._insert(ResultRow).values(kernel_id=kernel_id, device_id=device_id, **values)
        replaced = ("torch_version", "kilnx_version", "config", "time_s", "default_time_s", "peer_time_s",
                    "trials", "created")
        # The WHERE makes "keep the best" part of the single atomic statement: a worse result for an
        # existing identity changes nothing, whatever the order in which concurrent writers arrive.
        # Where both results carry the default config's time from their own run, the better one is the
        # larger gain over it (time / default, compared cross-multiplied): times from two runs are not
        # comparable when the GPU's clocks drifted between them, nor when they are step times of two
        # models whose weights share a bucket (the step trial's qmatmul_path). Otherwise the shorter time.
        new, old = ins.excluded, ResultRow
        both_gains = and_(old.default_time_s.is_not(None), new.default_time_s.is_not(None))
        better = or_(and_(both_gains, old.time_s * new.default_time_s > new.time_s * old.default_time_s),
                     and_(not_(both_gains), old.time_s > new.time_s))
        stmt = ins.on_conflict_do_update(
            index_elements=[ResultRow.kernel_id, ResultRow.device_id, ResultRow.bucket, ResultRow.triton_version],
            set_={name: ins.excluded[name] for name in replaced},
            where=better,
        )
        conn.execute(stmt)

    def _store_imported(self, devices: list[DeviceInfo], results: list[TunedResult]) -> None:
        """Used by import_json: everything in one transaction, so a failure leaves the DB as it was."""
        with self._transaction("import tuned results", write=True) as conn:
            device_ids = {info.key: self._upsert_device(conn, info) for info in devices}
            for index, r in enumerate(results):
                try:
                    values = _result_values(
                        kernel=r.kernel, source_hash=r.source_hash, bucket=r.bucket, config=r.config,
                        time_s=r.time_s, default_time_s=r.default_time_s, peer_time_s=r.peer_time_s,
                        trials=r.trials, created=r.created.astimezone(timezone.utc).replace(tzinfo=None),
                        versions={"triton": r.triton_version, "torch": r.torch_version, "kilnx": r.kilnx_version})
                except ValueError as e:
                    # Raised inside the transaction, so the rows written before it are rolled back.
                    raise DBError(f"result {index} of the import is invalid ({e}); nothing was imported.") from None
                kernel_id = self._upsert_kernel(conn, r.kernel, r.source_hash, values["created"])
                self._upsert_best(conn, device_ids[r.device_key], kernel_id, values)

    # ---- reading -----------------------------------------------------------------------------------

    def valid_results(self, device: DeviceInfo, source_hashes: dict[str, str] | None = None,
                      triton_version: str | None = None) -> list[TunedResult]:
        """Results the runtime may serve on `device`: same device key and triton version, and, when
        `source_hashes` is given, only kernels named there whose source hash matches."""
        triton_version = triton_version or installed_triton_version()
        with self._transaction("read tuned results") as conn:
            rows = conn.execute(_RESULT_SELECT.where(DeviceRow.key == device.key,
                                                     ResultRow.triton_version == triton_version)
                                .order_by(KernelRow.name, ResultRow.bucket)).all()
        results = [_to_result(row) for row in rows]
        if source_hashes is not None:
            results = [r for r in results if source_hashes.get(r.kernel) == r.source_hash]
        return results

    def all_results(self, device: DeviceInfo | None = None, source_hashes: dict[str, str] | None = None,
                    triton_version: str | None = None) -> list[tuple[TunedResult, str]]:
        """Every stored result with its status, "valid" or "stale: <why>", judged against `device`
        (when given), the installed triton and the current source hash of each kernel: `source_hashes`
        when the caller knows the code, else the most recently registered hash of that kernel name (the
        tuner registers what it tunes, so the newest tuned source counts as current)."""
        return [(r, status) for _, r, status in self._judged_results(device, source_hashes, triton_version)]

    def _judged_results(self, device, source_hashes, triton_version, conn: Connection | None = None):
        if conn is None:
            with self._transaction("read tuned results") as conn:
                return self._judged_results(device, source_hashes, triton_version, conn)
        triton_version = triton_version or installed_triton_version()
        rows = conn.execute(_RESULT_SELECT.add_columns(ResultRow.id)
                            .order_by(DeviceRow.key, KernelRow.name, ResultRow.bucket, KernelRow.source_hash)).all()
        current = dict(source_hashes) if source_hashes is not None else _latest_hashes(conn)
        judged = []
        for row in rows:
            r = _to_result(row)
            why = []
            if device is not None and r.device_key != device.key:
                why.append(f"tuned on {r.device_key}, not this device {device.key}")
            if current.get(r.kernel) != r.source_hash:
                now = current.get(r.kernel)
                why.append(f"kernel source changed ({r.source_hash[:12]} -> {now[:12]})" if now
                           else "kernel not in the current sources")
            if r.triton_version != triton_version:
                why.append(f"triton {r.triton_version}, installed {triton_version}")
            judged.append((row.id, r, "stale: " + "; ".join(why) if why else "valid"))
        return judged

    # ---- maintenance -------------------------------------------------------------------------------

    def prune(self, stale_only: bool = True, source_hashes: dict[str, str] | None = None) -> int:
        """Delete stale results (changed source, other triton), or every result; return how many.
        Results of other devices are kept: they are how a GPU's tuning travels (export/import)."""
        with self._transaction("prune tuned results", write=True) as conn:
            if stale_only:
                ids = [rid for rid, _, status in self._judged_results(None, source_hashes, None, conn)
                       if status != "valid"]
            else:
                ids = list(conn.execute(select(ResultRow.id)).scalars())
            for start in range(0, len(ids), 500):  # bounded IN lists
                conn.execute(delete(ResultRow).where(ResultRow.id.in_(ids[start:start + 500])))
            # Forget kernel hashes nothing refers to, except the current one of each name.
            latest = _latest_hashes(conn) if stale_only else {}
            used = set(conn.execute(select(ResultRow.kernel_id).distinct()).scalars())
            for kid, name, source_hash in conn.execute(select(KernelRow.id, KernelRow.name, KernelRow.source_hash)).all():
                if kid not in used and latest.get(name) != source_hash:
                    # Re-checked in SQL: a tuner may have just written a result for this hash.
                    in_use = select(ResultRow.id).where(ResultRow.kernel_id == kid).exists()
                    conn.execute(delete(KernelRow).where(KernelRow.id == kid, ~in_use))
        return len(ids)

    def optuna_storage(self):
        """An Optuna RDBStorage on this DB's URL (Optuna's own tables beside ours)."""
        import optuna
        engine_kwargs = {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S}} if self._is_sqlite else {}
        last_error: Exception | None = None
        # Workers starting together race to create Optuna's tables (create_all is check-then-create);
        # on PostgreSQL an advisory lock serializes them, and a retry absorbs a lost race on SQLite.
        for attempt in range(5):
            try:
                with self._schema_lock():
                    return optuna.storages.RDBStorage(self.url, engine_kwargs=engine_kwargs)
            except (sa_exc.SQLAlchemyError, sqlite3.Error) as e:
                last_error = e
                time.sleep(0.2 * (attempt + 1))
        raise explain(last_error, self.url, "open the Optuna storage")

    @contextmanager
    def _schema_lock(self):
        if self._is_sqlite:
            yield
            return
        with self._engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _SCHEMA_LOCK_KEY})
                conn.commit()

    def export_json(self, path, device: DeviceInfo | None = None) -> int:
        from kilnx.cache.transfer import export_json
        return export_json(self, path, device)

    def import_json(self, path) -> int:
        from kilnx.cache.transfer import import_json
        return import_json(self, path)

    def plot(self, out_dir, study_names: list[str] | None = None) -> list[Path]:
        from kilnx.cache.plots import plot_db
        return plot_db(self, out_dir, study_names)

    def devices(self) -> list[DeviceInfo]:
        with self._transaction("read devices") as conn:
            infos = conn.execute(select(DeviceRow.info).order_by(DeviceRow.key)).scalars().all()
        return [DeviceInfo.from_dict(info) for info in infos]


# ---- module helpers -------------------------------------------------------------------------------

_RESULT_SELECT = (
    select(KernelRow.name, KernelRow.source_hash, DeviceRow.key, ResultRow.bucket, ResultRow.config,
           ResultRow.time_s, ResultRow.default_time_s, ResultRow.peer_time_s, ResultRow.trials,
           ResultRow.triton_version, ResultRow.torch_version, ResultRow.kilnx_version, ResultRow.created)
    .join_from(ResultRow, KernelRow, ResultRow.kernel_id == KernelRow.id)
    .join(DeviceRow, ResultRow.device_id == DeviceRow.id)
)


def _to_result(row) -> TunedResult:
    created = row.created if row.created.tzinfo else row.created.replace(tzinfo=timezone.utc)
    return TunedResult(kernel=row.name, source_hash=row.source_hash, device_key=row.key, bucket=row.bucket,
                       config=dict(row.config), time_s=row.time_s, default_time_s=row.default_time_s,
                       peer_time_s=row.peer_time_s, trials=row.trials, triton_version=row.triton_version,
                       torch_version=row.torch_version, kilnx_version=row.kilnx_version, created=created)


def _latest_hashes(conn: Connection) -> dict[str, str]:
    """kernel name -> its most recently registered source hash."""
    latest: dict[str, tuple] = {}
    for name, source_hash, seen in conn.execute(select(KernelRow.name, KernelRow.source_hash, KernelRow.last_seen)):
        if name not in latest or (seen, source_hash) > latest[name]:
            latest[name] = (seen, source_hash)
    return {name: source_hash for name, (_, source_hash) in latest.items()}


def _read_schema_version(conn: Connection) -> int | None:
    if not inspect(conn).has_table(SchemaVersionRow.__tablename__):
        return None
    return conn.execute(select(SchemaVersionRow.version).where(SchemaVersionRow.id == 1)).scalar_one_or_none()


def _check_identity(**fields: str) -> None:
    limits = {"kernel": 255, "source_hash": 128, "bucket": 255}
    for name, value in fields.items():
        if not isinstance(value, str) or not value.strip() or len(value) > limits[name]:
            raise ValueError(f"{name} must be a non-empty string of at most {limits[name]} characters, got {value!r}")


def _result_values(*, kernel, source_hash, bucket, config, time_s, default_time_s, peer_time_s, trials,
                   versions, created) -> dict:
    """Validated column values of a result row (shared by record_result and import)."""
    _check_identity(kernel=kernel, source_hash=source_hash, bucket=bucket)
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        raise ValueError(f"config must be a dict with string keys, got {config!r}")
    try:
        # Round-trip through JSON so what is stored is exactly what any backend hands back.
        config = json.loads(json.dumps(config, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"config must be JSON-serializable: {e}") from None
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
        raise ValueError(f"trials must be a non-negative int, got {trials!r}")
    for key in ("triton", "torch", "kilnx"):
        if not isinstance(versions.get(key), str) or not versions[key]:
            raise ValueError(f"versions[{key!r}] must be a non-empty string, got {versions.get(key)!r}")
    return {"bucket": bucket, "config": config, "time_s": check_time("time_s", time_s, True),
            "default_time_s": check_time("default_time_s", default_time_s, False),
            "peer_time_s": check_time("peer_time_s", peer_time_s, False), "trials": trials,
            "triton_version": versions["triton"], "torch_version": versions["torch"],
            "kilnx_version": versions["kilnx"], "created": created}


def _make_engine(url: str) -> Engine:
    try:
        parsed = make_url(url)
    except sa_exc.ArgumentError:
        raise DBError(f"{url!r} is not a database URL; use {_URL_EXAMPLES}.") from None
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise DBError(f"{display_url(url)}: unsupported database {backend!r}; use {_URL_EXAMPLES}.")
    connect_args: dict = {}
    if backend == "sqlite":
        connect_args["timeout"] = SQLITE_BUSY_TIMEOUT_S
    elif "connect_timeout" not in parsed.query:
        connect_args["connect_timeout"] = PG_CONNECT_TIMEOUT_S
    try:
        engine = create_engine(parsed, connect_args=connect_args)
    except (sa_exc.NoSuchModuleError, ImportError) as e:
        raise DBError(f"{display_url(url)}: no database driver for it ({e}); for PostgreSQL use "
                      f"postgresql+psycopg://... with `pip install 'psycopg[binary]'`.") from None
    if backend == "sqlite":
        _configure_sqlite(engine, in_memory=parsed.database in (None, "", ":memory:"))
    return engine


def _configure_sqlite(engine: Engine, in_memory: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        # Let SQLAlchemy's "begin" event below issue BEGIN itself, instead of pysqlite's implicit one,
        # so writes can ask for BEGIN IMMEDIATE.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute("PRAGMA foreign_keys=ON")
            if not in_memory:
                # WAL: readers (the runtime) never block writers (tuner workers), and vice versa.
                cursor.execute("PRAGMA journal_mode=WAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("kilnx_immediate") else "BEGIN")
