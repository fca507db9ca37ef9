"""Tuning budgets: how long the whole tune may run, and how that time is shared across targets.

`--budget 10m` is one deadline for the whole command. Each kernel×bucket target gets an equal share
of what is *left* when it starts, so time a quick target did not use flows to the ones after it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)?")


def parse_duration(text: str) -> float:
    """'90s' -> 90.0, '2m' -> 120.0, '1h30m' -> 5400.0, a bare number means seconds."""
    s = str(text).strip().lower()
    if not s:
        raise ValueError("empty duration; use e.g. 90s, 2m or 1h")
    pos, total = 0, 0.0
    while pos < len(s):
        m = _PART.match(s, pos)
        if not m or m.end() == pos:
            raise ValueError(f"cannot read duration {text!r}; use e.g. 90s, 2m, 1h or 1h30m")
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2) or "s"]
        pos = m.end()
        while pos < len(s) and s[pos] == " ":
            pos += 1
    if total <= 0:
        raise ValueError(f"duration {text!r} must be positive")
    return total


@dataclass
class Budget:
    """One overall deadline split across `targets` in order."""

    total_s: float
    targets: int
    started: float = field(default_factory=time.monotonic)
    done: int = 0  # targets finished so far

    def remaining_s(self) -> float:
        return max(0.0, self.total_s - (time.monotonic() - self.started))

    def next_target_seconds(self) -> float:
        """Seconds the next target may use: an equal share of what is left."""
        left_targets = max(1, self.targets - self.done)
        return self.remaining_s() / left_targets

    def finish_target(self) -> None:
        self.done += 1
