"""The tuning DB: tuned kernel configs keyed by kernel source, device and triton version.

    from kilnx.cache import TuningDB, DBError, TunedResult
"""

from kilnx.cache.db import TuningDB, default_url
from kilnx.cache.errors import DBError
from kilnx.cache.result import TunedResult, current_versions

__all__ = ["TuningDB", "DBError", "TunedResult", "current_versions", "default_url"]
