"""Tile helpers composed of the core ops (no IR op of their own, so every backend has them)."""

from __future__ import annotations

from kilnx.dsl.ir import dsl_error
from kilnx.dsl.lang import Value, arange, sum, where  # noqa: A004 - kd.sum


def halves(x: Value, axis: int):
    """(x[..., 0, ...], x[..., 1, ...]): the two slices of x along `axis`, which has size 2, each without
    that axis. With kd.reshape, this is how a kernel takes a tile's interleaved halves apart (e.g. the
    two members of rotary pairs)."""
    ax = axis % len(x.shape)
    if x.shape[ax] != 2:
        raise dsl_error(f"kd.halves takes an axis of size 2, got {list(x.shape)} along axis {axis}")
    index = arange(0, 2)[tuple(slice(None) if i == ax else None for i in range(len(x.shape)))]
    return sum(where(index == 0, x, 0.0), axis=ax), sum(where(index == 1, x, 0.0), axis=ax)
