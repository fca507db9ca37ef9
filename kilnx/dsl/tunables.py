"""Typed tunables: what a kernel author declares and what the tuner searches.

Each tunable knows its candidate values and default; a `Space` is a flat, ordered set of them plus
constraints over whole configs. A config is a plain ``dict[str, int | bool | str]`` so that it
serialises to JSON and maps one-to-one onto an Optuna distribution.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

Config = dict[str, Any]


class SpaceError(ValueError):
    """A tunable space that cannot be searched (empty, or a default that breaks a constraint)."""


@dataclass(frozen=True)
class Tunable:
    values: tuple
    default: Any

    def __post_init__(self):
        if not self.values:
            raise SpaceError("a tunable needs at least one value")
        if self.default not in self.values:
            raise SpaceError(f"default {self.default!r} is not one of {self.values!r}")


def pow2(lo: int, hi: int, default: int | None = None) -> Tunable:
    """Powers of two from lo to hi inclusive."""
    if lo <= 0 or hi < lo or lo & (lo - 1) or hi & (hi - 1):
        raise SpaceError(f"pow2({lo}, {hi}): bounds must be powers of two with lo <= hi")
    vals = tuple(1 << i for i in range(lo.bit_length() - 1, hi.bit_length()))
    return Tunable(vals, default if default is not None else vals[len(vals) // 2])


def int_range(lo: int, hi: int, step: int = 1, default: int | None = None) -> Tunable:
    vals = tuple(range(lo, hi + 1, step))
    return Tunable(vals, default if default is not None else (vals[0] if vals else None))


def choice(*values, default=None) -> Tunable:
    return Tunable(tuple(values), default if default is not None else (values[0] if values else None))


def boolean(default: bool = False) -> Tunable:
    return Tunable((False, True), default)


@dataclass
class Space:
    """Named tunables and the constraints a config must satisfy (checked before compiling)."""

    params: dict[str, Tunable] = field(default_factory=dict)
    constraints: tuple[Callable[..., bool], ...] = ()

    def __post_init__(self):
        for c in self.constraints:
            names = inspect.signature(c).parameters
            unknown = [n for n in names if n not in self.params]
            if unknown:
                raise SpaceError(f"constraint {c.__name__} names unknown tunables {unknown}")
        if self.params and not self.is_valid(self.default()):
            raise SpaceError(f"the default config {self.default()} breaks a constraint")

    def default(self) -> Config:
        return {k: t.default for k, t in self.params.items()}

    def is_valid(self, config: Config) -> bool:
        for c in self.constraints:
            args = {n: config[n] for n in inspect.signature(c).parameters}
            if not c(**args):
                return False
        return True

    def validate(self, config: Config) -> Config:
        """A full config from a partial one (missing names take defaults); raises if invalid."""
        unknown = set(config) - set(self.params)
        if unknown:
            raise SpaceError(f"unknown tunables {sorted(unknown)}; this space has {list(self.params)}")
        full = {**self.default(), **config}
        for k, v in full.items():
            if v not in self.params[k].values:
                raise SpaceError(f"{k}={v!r} is not one of {self.params[k].values}")
        if not self.is_valid(full):
            raise SpaceError(f"config {full} breaks a constraint")
        return full

    def __iter__(self) -> Iterator[Config]:
        """Every valid config (for small spaces and tests; the tuner samples instead)."""
        names = list(self.params)
        for combo in itertools.product(*(self.params[n].values for n in names)):
            cfg = dict(zip(names, combo))
            if self.is_valid(cfg):
                yield cfg

    def size(self) -> int:
        n = 1
        for t in self.params.values():
            n *= len(t.values)
        return n

    def suggest(self, trial) -> Config:
        """Draw a config from an Optuna trial: each tunable is a categorical over its values."""
        return {k: trial.suggest_categorical(k, list(t.values)) for k, t in self.params.items()}

    def describe(self) -> str:
        return ", ".join(f"{k}∈{list(t.values)} (default {t.default})" for k, t in self.params.items())
