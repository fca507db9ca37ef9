"""The tuning DB: tuned kernel configs keyed by kernel source, device and triton version.

    from kilnx.cache import TuningDB, DBError, TunedResult

TuningDB (and SQLAlchemy with it) is imported on first use: a starting runtime reads its configs from
a snapshot without it (kilnx/cache/snapshot.py).
"""

from kilnx.cache.errors import DBError
from kilnx.cache.location import default_url
from kilnx.cache.result import TunedResult, current_versions

__all__ = ["TuningDB", "DBError", "TunedResult", "current_versions", "default_url"]


def __getattr__(name):
    if name == "TuningDB":
        from kilnx.cache.db import TuningDB
        return TuningDB
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
