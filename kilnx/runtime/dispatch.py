"""Tuned configs at run time: load once per device, answer per launch, never tune.

A kernel launch asks `config_for(kernel, source_hash, bucket, default)`. The answer is the config tuned
for exactly that bucket, else the one tuned for the nearest bucket of the same kernel source, else the
kernel's default. Only results the DB calls valid for this device and the installed triton are loaded,
and the source hash must match, so a config tuned for other code or another GPU is never served.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from typing import TYPE_CHECKING

from kilnx.cache import DBError, TunedResult, snapshot
from kilnx.cache.location import default_url
from kilnx.cache.result import installed_triton_version
from kilnx.runtime.device import DeviceInfo

if TYPE_CHECKING:
    from kilnx.cache.db import TuningDB

BucketFields = dict[str, "float | str"]


def parse_bucket(bucket: str) -> BucketFields | None:
    """"M=1,N=4096,K=4096" -> {"M": 1.0, "N": 4096.0, "K": 4096.0}; non-numeric values stay strings.
    None when the string is not key=value pairs (such a bucket only ever matches exactly)."""
    fields: BucketFields = {}
    for part in bucket.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or key in fields:
            return None
        try:
            number = float(value)
            fields[key] = number if math.isfinite(number) else value
        except ValueError:
            fields[key] = value
    return fields


def bucket_distance(a: BucketFields, b: BucketFields) -> float:
    """Sum of |log2(a/b)| over numeric fields; inf when the buckets are not comparable (different keys,
    different non-numeric values, or a non-positive size that differs)."""
    if a.keys() != b.keys():
        return math.inf
    total = 0.0
    for key, x in a.items():
        y = b[key]
        if isinstance(x, str) or isinstance(y, str):
            if x != y:
                return math.inf
        elif x != y:
            if x <= 0 or y <= 0:
                return math.inf  # no ratio to speak of; a size-0 bucket only matches itself
            total += abs(math.log2(x / y))
    return total


class TunedConfigs:
    """The valid tuned configs of one device, in memory."""

    def __init__(self, device: DeviceInfo, entries: list[snapshot.Entry]):
        """entries: (kernel, source hash, bucket, config) of results valid on `device`."""
        self.device = device
        # (kernel, source_hash) -> bucket -> config
        self._configs: dict[tuple[str, str], dict[str, dict]] = {}
        for kernel, source_hash, bucket, config in entries:
            self._configs.setdefault((kernel, source_hash), {})[bucket] = config
        self._parsed: dict[tuple[str, str], list[tuple[str, BucketFields]]] = {
            ident: [(b, f) for b in sorted(buckets) if (f := parse_bucket(b)) is not None]
            for ident, buckets in self._configs.items()}
        # Launches repeat the same few buckets; remember which stored bucket answered each.
        self._answers: dict[tuple[str, str, str], str | None] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(cls, device: DeviceInfo, db: "TuningDB | None" = None) -> "TunedConfigs":
        """Read the device's valid results once. An unusable DB warns (once) and yields no configs,
        so the runtime still runs, on default configs."""
        try:
            return cls(device, _valid_entries(device, db))
        except DBError as e:
            _warn_once(f"kilnx: tuning DB unavailable, using default kernel configs: {e}")
            return cls(device, [])

    def config_for(self, kernel_name: str, source_hash: str, bucket: str, default: dict, nearest: bool = True) -> dict:
        """nearest=False: the bucket's own config or the default (a kernel whose configs hold only where tuned)."""
        ident = (kernel_name, source_hash)
        buckets = self._configs.get(ident)
        if not buckets:
            return dict(default)
        if bucket in buckets:
            return dict(buckets[bucket])
        if not nearest:
            return dict(default)
        key = (kernel_name, source_hash, bucket)
        with self._lock:
            if key not in self._answers:
                self._answers[key] = self._nearest(ident, bucket)
            chosen = self._answers[key]
        return dict(buckets[chosen]) if chosen is not None else dict(default)

    def _nearest(self, ident: tuple[str, str], bucket: str) -> str | None:
        wanted = parse_bucket(bucket)
        if wanted is None:
            return None
        best: tuple[float, str] | None = None
        for stored, fields in self._parsed.get(ident, []):
            distance = bucket_distance(wanted, fields)
            # Ties (e.g. M=2 between M=1 and M=4) go to the lexicographically first bucket: arbitrary
            # but stable, so the same shape always gets the same config.
            if math.isfinite(distance) and (best is None or (distance, stored) < best):
                best = (distance, stored)
        return best[1] if best else None

    def coverage(self) -> dict[str, list[str]]:
        """kernel -> the buckets it has tuned configs for (over all its loaded source hashes)."""
        covered: dict[str, set[str]] = {}
        for (kernel, _), buckets in self._configs.items():
            covered.setdefault(kernel, set()).update(buckets)
        return {kernel: sorted(buckets) for kernel, buckets in sorted(covered.items())}

    def __len__(self) -> int:
        return sum(len(b) for b in self._configs.values())


def _valid_entries(device: DeviceInfo, db: "TuningDB | None") -> list[snapshot.Entry]:
    """`db`'s valid results for `device`; without a `db`, the default DB's: from its snapshot while that
    still matches the SQLite file (no SQLAlchemy import), else read and the snapshot rewritten."""
    if db is not None:
        return _entries(db.valid_results(device))
    url = default_url()
    triton = installed_triton_version()
    snap = snapshot.Snapshot.of(url, device.key, triton)
    entries = snap.read() if snap is not None else None
    if entries is not None:
        return entries
    from kilnx.cache.db import TuningDB
    with TuningDB(url) as opened:
        entries = _entries(opened.valid_results(device, triton_version=triton))
    if snap is not None:
        snap.write(entries)
    return entries


def _entries(results: list[TunedResult]) -> list[snapshot.Entry]:
    return [(r.kernel, r.source_hash, r.bucket, r.config) for r in results]


_cache: dict[str, TunedConfigs] = {}
_cache_lock = threading.Lock()
_warned: set[str] = set()


def get_tuned(device: DeviceInfo | None = None, db: "TuningDB | None" = None) -> TunedConfigs:
    """The process-wide TunedConfigs of `device` (default: this machine's), loaded on first use."""
    if device is None:
        from kilnx.runtime.device import detect
        device = detect("auto")
    with _cache_lock:
        if device.key not in _cache:
            _cache[device.key] = TunedConfigs.load(device, db)
        return _cache[device.key]


def reset() -> None:
    """Forget loaded configs (and warnings given), e.g. after tuning wrote new results."""
    from kilnx.dsl.kernel import forget_remembered_configs
    with _cache_lock:
        _cache.clear()
        _warned.clear()
    forget_remembered_configs()   # kernels remember which config each call shape got


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _device_info(kind: str, index: int) -> DeviceInfo:
    from kilnx.runtime.device import cpu_info, cuda_info
    return cuda_info(index) if kind == "cuda" else cpu_info()


def config_for(kernel, args: tuple, kw: dict) -> dict:
    """The config a kernel call launches with: the tuned one for this device and shape bucket (or the
    nearest tuned bucket, unless the kernel sets `exact_buckets`), else the kernel's default. Reads only what
    `get_tuned` loaded at start-up."""
    default = kernel.default_config(*args, **kw)
    dev = next((a.device for a in args if hasattr(a, "device")), None)
    info = _device_info(dev.type if dev is not None else "cpu", (dev.index or 0) if dev is not None else 0)
    cfg = get_tuned(info).config_for(kernel.name, kernel.source_hash, kernel.key(*args, **kw), default,
                                     nearest=not getattr(kernel, "exact_buckets", False))
    try:
        return kernel.space.validate(cfg)
    except ValueError:  # a stored config this version's space no longer admits
        return default
