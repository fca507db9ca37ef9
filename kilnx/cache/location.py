"""Where kilnx keeps its files: the cache root (KILNX_CACHE_DIR, else the user cache dir), the default
tuning DB URL, and how a file there is replaced. Imports nothing heavy: the runtime asks at start-up."""

from __future__ import annotations

import os
from pathlib import Path

from kilnx.cache.errors import DBError


def _user_cache_dir() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("kilnx"))


def cache_root() -> Path:
    """KILNX_CACHE_DIR if set, else the user's cache dir for kilnx (not created here)."""
    root = os.environ.get("KILNX_CACHE_DIR")
    return Path(root) if root else _user_cache_dir()


def write_atomically(path: Path, text: str) -> None:
    """Write text to path by a private file renamed over it: a concurrent reader sees the old file or the
    new one, never half of one. Creates the parent directory; raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def default_url() -> str:
    """KILNX_DB if set, else a SQLite file in the user's cache dir (created if missing)."""
    env = os.environ.get("KILNX_DB", "").strip()
    if env:
        return env
    cache_dir = _user_cache_dir()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DBError(f"cannot create the tuning DB directory {cache_dir} ({e.strerror or e}); "
                      "set KILNX_DB or pass --db to use another location.") from None
    return f"sqlite:///{cache_dir}/tuning.db"
