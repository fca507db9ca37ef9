"""TunedResult: what the tuning DB hands out (plain frozen data, never an ORM object), and the
version stamp a result is keyed by."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata

import kilnx


@dataclass(frozen=True)
class TunedResult:
    kernel: str
    source_hash: str
    device_key: str
    bucket: str
    config: dict = field(hash=False)
    time_s: float
    default_time_s: float | None
    peer_time_s: float | None
    trials: int
    triton_version: str
    torch_version: str
    kilnx_version: str
    created: datetime

    @property
    def speedup(self) -> float | None:
        """Default config's time over the tuned time (>1: tuning helped)."""
        if self.default_time_s is None or self.time_s <= 0:
            return None
        return self.default_time_s / self.time_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["created"] = self.created.isoformat()
        return d


def _installed(package: str) -> str:
    # Read the installed distribution's metadata instead of importing: importing torch/triton costs
    # seconds, and the runtime asks for these versions on every start.
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def installed_triton_version() -> str:
    return _installed("triton")


def installed_kilnx_version() -> str:
    # getattr: a stale editable install can map `kilnx` as a namespace package without __init__.
    return getattr(kilnx, "__version__", None) or _installed("kilnx")


def current_versions() -> dict:
    return {"triton": installed_triton_version(), "torch": _installed("torch"), "kilnx": installed_kilnx_version()}


def utcnow() -> datetime:
    """Naive UTC: what both SQLite and PostgreSQL store identically in a plain DateTime column."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def check_time(name: str, value: float | None, required: bool) -> float | None:
    """A benchmark time must be a finite positive number (NaN would break best-keeping)."""
    if value is None:
        if required:
            raise ValueError(f"{name} is required")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number of seconds, got {value!r}")
    return float(value)
