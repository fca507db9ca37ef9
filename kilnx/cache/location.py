"""Where kilnx keeps its files: the cache root (KILNX_CACHE_DIR, else the user cache dir) and the default
tuning DB URL. Imports nothing heavy: the runtime asks at start-up."""

from __future__ import annotations

import os
from pathlib import Path

from kilnx.cache.errors import DBError


def cache_root() -> Path:
    """KILNX_CACHE_DIR if set, else the user's cache dir for kilnx (not created here)."""
    root = os.environ.get("KILNX_CACHE_DIR")
    if root:
        return Path(root)
    import platformdirs
    return Path(platformdirs.user_cache_dir("kilnx"))


def default_url() -> str:
    """KILNX_DB if set, else a SQLite file in the user's cache dir (created if missing)."""
    env = os.environ.get("KILNX_DB", "").strip()
    if env:
        return env
    import platformdirs
    cache_dir = Path(platformdirs.user_cache_dir("kilnx"))
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DBError(f"cannot create the tuning DB directory {cache_dir} ({e.strerror or e}); "
                      "set KILNX_DB or pass --db to use another location.") from None
    return f"sqlite:///{cache_dir}/tuning.db"
