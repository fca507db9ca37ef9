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
from pathlib import Path

from kilnx.cache.location import cache_root, write_atomically

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


class Snapshot:
    """The snapshot of one SQLite DB's valid results for one device and triton version. `read()` stamps
    the DB file as it finds it; `write()` stores entries under that stamp, so call it with what a DB read
    started after `read()` returned (a write to the DB in between makes the next `read()` miss)."""

    def __init__(self, db_file: Path, device_key: str, triton_version: str):
        from kilnx.cache.result import installed_kilnx_version
        self.db_file, self.stamp = db_file, None
        # kilnx's version too: a new kilnx may judge the DB's rows (or its schema) differently, so it reads
        # the DB once itself
        ident = json.dumps([FORMAT, str(db_file), device_key, triton_version, installed_kilnx_version()])
        self.path = cache_root() / "tuned" / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}.json"

    @classmethod
    def of(cls, url: str, device_key: str, triton_version: str) -> "Snapshot | None":
        """The snapshot for a SQLite file URL; None for anything else (those are always read)."""
        db_file = sqlite_file(url)
        return None if db_file is None else cls(db_file, device_key, triton_version)

    def read(self) -> list[Entry] | None:
        """The stored entries if they still match the DB file, else None (no snapshot, a changed DB, an
        unreadable file: the caller reads the DB)."""
        self.stamp = stamp(self.db_file)
        if self.stamp is None:
            return None
        try:
            data = json.loads(self.path.read_text())
            if data.get("format") != FORMAT or data.get("stamp") != self.stamp:
                return None
            return [(e[0], e[1], e[2], dict(e[3])) for e in data["entries"]]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None

    def write(self, entries: list[Entry]) -> None:
        """Store entries under the stamp `read()` took. Best effort: a cache directory that cannot be
        written only means the next start reads the DB again."""
        if self.stamp is None:
            return              # no DB file before the read: the next start stamps the one it made
        data = {"format": FORMAT, "db": str(self.db_file), "stamp": self.stamp, "entries": [list(e) for e in entries]}
        try:
            write_atomically(self.path, json.dumps(data))
        except OSError:
            pass
