"""Moving tuned results between machines as JSON (tune on the GPU box, import where you run).

The file carries the full DeviceInfo of each device so the importing DB knows GPUs it has never seen.
Import validates the whole file before touching the DB and writes it in one transaction: either every
result is applied (with the usual keep-the-best rule) or nothing is.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from kilnx.cache.errors import DBError
from kilnx.cache.result import TunedResult
from kilnx.runtime.device import DeviceInfo

if TYPE_CHECKING:
    from kilnx.cache.db import TuningDB

FORMAT_NAME = "kilnx-tuning-results"
FORMAT_VERSION = 1


def export_json(db: "TuningDB", path, device: DeviceInfo | None = None) -> int:
    """Write the results (of `device`, else all) to `path`; return how many."""
    results = [r for r, _ in db.all_results()]
    if device is not None:
        results = [r for r in results if r.device_key == device.key]
    keys = {r.device_key for r in results}
    devices = [info.to_dict() for info in db.devices() if info.key in keys]
    document = {"format": FORMAT_NAME, "version": FORMAT_VERSION,
                "exported": datetime.now(timezone.utc).isoformat(),
                "devices": devices, "results": [r.to_dict() for r in results]}
    path = Path(path)
    # Write to a sibling temp file and rename, so an interrupted export never leaves a truncated file
    # that a later import would reject (or worse, half-accept).
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        raise DBError(f"cannot write {path}: {e.strerror or e}; choose a writable path.") from None
    return len(results)


def import_json(db: "TuningDB", path) -> int:
    """Apply the results in `path` to `db`; return how many the file held. All or nothing."""
    devices, results = read_export(path)
    db._store_imported(devices, results)
    return len(results)


def read_export(path) -> tuple[list[DeviceInfo], list[TunedResult]]:
    """Parse and validate an export file; raise DBError naming the first problem."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except OSError as e:
        raise DBError(f"cannot read {path}: {e.strerror or e}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DBError(f"{path} is not valid JSON ({e}); nothing was imported. "
                      "Re-export it with `kilnx db export`.") from None
    problem = _Problems(path)
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        problem.fail("", f"not a kilnx export (expected \"format\": \"{FORMAT_NAME}\")")
    if document.get("version") != FORMAT_VERSION:
        problem.fail("version", f"export format version {document.get('version')!r}, this kilnx reads "
                                f"{FORMAT_VERSION}")
    devices = _read_devices(document.get("devices"), problem)
    known = {info.key for info in devices}
    raw_results = document.get("results")
    if not isinstance(raw_results, list):
        problem.fail("results", "must be a list")
    results = [_read_result(item, f"results[{i}]", known, problem) for i, item in enumerate(raw_results)]
    return devices, results


class _Problems:
    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, what: str):
        at = f" at {where}" if where else ""
        raise DBError(f"{self.path} is not a valid kilnx export{at}: {what}; nothing was imported.")


def _read_devices(raw, problem: _Problems) -> list[DeviceInfo]:
    if not isinstance(raw, list):
        problem.fail("devices", "must be a list")
    devices = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not all(isinstance(item.get(k), str) and item.get(k)
                                                 for k in ("name", "arch")):
            problem.fail(f"devices[{i}]", "needs string fields name and arch")
        try:
            devices.append(DeviceInfo.from_dict(item))
        except (TypeError, ValueError) as e:
            problem.fail(f"devices[{i}]", str(e))
    return devices


_STRINGS = ("kernel", "source_hash", "device_key", "bucket", "triton_version", "torch_version", "kilnx_version")


def _read_result(item, where: str, known_devices: set[str], problem: _Problems) -> TunedResult:
    if not isinstance(item, dict):
        problem.fail(where, "must be an object")
    for name in _STRINGS:
        if not isinstance(item.get(name), str) or not item[name].strip():
            problem.fail(f"{where}.{name}", "must be a non-empty string")
    if item["device_key"] not in known_devices:
        problem.fail(f"{where}.device_key", f"{item['device_key']!r} is not among the file's devices")
    if not isinstance(item.get("config"), dict):
        problem.fail(f"{where}.config", "must be an object")
    for name in ("time_s", "default_time_s", "peer_time_s"):
        value = item.get(name)
        if value is None and name != "time_s":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            problem.fail(f"{where}.{name}", f"must be a positive number of seconds, got {value!r}")
    trials = item.get("trials", 0)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
        problem.fail(f"{where}.trials", f"must be a non-negative integer, got {trials!r}")
    try:
        created = datetime.fromisoformat(item["created"])
    except (KeyError, TypeError, ValueError):
        problem.fail(f"{where}.created", "must be an ISO-8601 timestamp")
    if created.tzinfo is None:
        created = created.replace(tzinfo=timezone.utc)
    return TunedResult(**{name: item[name] for name in _STRINGS}, config=item["config"], time_s=float(item["time_s"]),
                       default_time_s=_float_or_none(item.get("default_time_s")),
                       peer_time_s=_float_or_none(item.get("peer_time_s")), trials=trials, created=created)


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)
