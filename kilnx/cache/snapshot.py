"""The runtime's copy of one device's valid tuned configs, kept beside the kilnx cache for a SQLite DB.

A starting process needs only (kernel, source hash, bucket, config) for its device. Reading them through
the DB meant importing SQLAlchemy, 0.3-0.4 s of a llama-3.1-8b cold start on the H200 host (~3 s in all)
and on its critical path (bench/probes/cold_phases.py). So after a read through the DB the runtime
writes what it got to a JSON file stamped with the DB file's size and mtime (and its WAL's), taken before
the read; the next process uses that file only while the stamp still matches, so any write to the DB
(a tune, an import, a prune) sends it back to the DB. PostgreSQL URLs always read the DB: there is no
cheap way to tell that a server's rows did not change.

Nothing here imports SQLAlchemy.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kilnx.cache.location import cache_root

FORMAT = 1
Entry = tuple[str, str, str, dict]   # kernel, source hash, bucket, config


def sqlite_file(url: str) -> Path | None:
    """The file of a `sqlite:///path` URL (driver suffixes allowed); None for memory DBs and servers."""
    scheme, sep, rest = url.partition(":///")
    if not sep or scheme.split("+", 1)[0] != "sqlite":
        return None
    path = rest.split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return Path(path).resolve()


def stamp(db_file: Path) -> list | None:
    """(size, mtime_ns) of the DB file and of its WAL (None where absent); None without the DB file."""
    parts = []
    for f in (db_file, db_file.with_name(db_file.name + "-wal")):
        try:
            st = f.stat()
            parts.append([st.st_size, st.st_mtime_ns])
        except FileNotFoundError:
            parts.append(None)
    return parts if parts[0] is not None else None


def snapshot_path(db_file: Path, device_key: str, triton_version: str) -> Path:
    # kilnx's version too: a new kilnx may judge the DB's rows (or its schema) differently, so it reads
    # the DB once itself
    from kilnx.cache.result import current_versions
    ident = json.dumps([FORMAT, str(db_file), device_key, triton_version, current_versions()["kilnx"]])
    digest = hashlib.sha256(ident.encode()).hexdigest()[:24]
    return cache_root() / "tuned" / f"{digest}.json"


def read(url: str, device_key: str, triton_version: str) -> list[Entry] | None:
    """The stored entries if the snapshot of this DB, device and triton still matches the DB file, else
    None (no snapshot, a changed DB, or an unreadable file: the caller reads the DB)."""
    db_file = sqlite_file(url)
    if db_file is None:
        return None
    now = stamp(db_file)
    if now is None:
        return None
    try:
        data = json.loads(snapshot_path(db_file, device_key, triton_version).read_text())
        if data.get("format") != FORMAT or data.get("stamp") != now:
            return None
        return [(e[0], e[1], e[2], dict(e[3])) for e in data["entries"]]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def write(url: str, device_key: str, triton_version: str, before: list | None, entries: list[Entry]) -> None:
    """Store entries read from the DB whose file had stamp `before` when the read began. Best effort: a
    cache directory that cannot be written only means the next start reads the DB again."""
    db_file = sqlite_file(url)
    if db_file is None or before is None:
        return
    path = snapshot_path(db_file, device_key, triton_version)
    data = {"format": FORMAT, "db": str(db_file), "device": device_key, "triton": triton_version,
            "stamp": before, "entries": [list(e) for e in entries]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)       # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass
