"""The one error type the tuning DB raises, and the translation of driver errors into it.

Callers (the CLI, the tuner, the runtime) show `str(DBError)` as a single line, so every message names
what went wrong *and* what to do about it; driver tracebacks never reach the user.
"""

from __future__ import annotations

# SQLAlchemy is imported where an error is explained, not here: the runtime imports DBError at start-up
# and reads its tuned configs without SQLAlchemy (kilnx/cache/snapshot.py).


class DBError(RuntimeError):
    """The tuning DB cannot be used as asked; the message says why and how to fix it."""


def display_url(url: str) -> str:
    """The URL with its password masked, for messages."""
    from sqlalchemy.engine import make_url
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - an unparsable URL is shown as given
        return url


_FIX_URL = "pass another --db URL or set KILNX_DB"


def explain(error: BaseException, url: str, action: str) -> DBError:
    """Turn a SQLAlchemy/driver error raised while doing `action` on `url` into one actionable DBError."""
    from sqlalchemy import exc as sa_exc
    from sqlalchemy.engine import make_url
    shown = display_url(url)
    detail = _first_line(getattr(error, "orig", None) or error)
    low = detail.lower()
    is_sqlite = shown.startswith("sqlite")
    if is_sqlite:
        path = make_url(url).database or ":memory:"
        if "file is not a database" in low or "malformed" in low or "not a database" in low:
            return DBError(f"{path} is not a readable SQLite tuning DB ({detail}). Move the file aside or delete "
                           f"it (its tuned results are lost), or {_FIX_URL}.")
        if "unable to open database file" in low:
            return DBError(f"cannot open SQLite file {path} ({detail}): check that its directory exists and is "
                           f"writable, or {_FIX_URL}.")
        if "locked" in low or "busy" in low:
            return DBError(f"SQLite DB {path} stayed locked by another process while trying to {action} "
                           f"({detail}); retry when the other writer is done, or use PostgreSQL for many workers.")
        if "readonly" in low or "read-only" in low:
            return DBError(f"SQLite DB {path} is read-only ({detail}); fix its permissions or {_FIX_URL}.")
    else:
        if isinstance(error, (sa_exc.OperationalError, sa_exc.InterfaceError)) and (
                "connect" in low or "connection" in low or "timeout" in low or "server" in low
                or "authentication" in low or "does not exist" in low or "resolve" in low):
            return DBError(f"cannot connect to {shown} ({detail}): start the database server or fix the URL "
                           f"(host, port, user, password, database name), or {_FIX_URL}.")
    return DBError(f"could not {action} in tuning DB {shown}: {detail}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0].strip()
