"""Tile helpers composed of the core ops (no IR op of their own, so every backend has them)."""

from __future__ import annotations

from kilnx.dsl.ir import dsl_error, is_float
from kilnx.dsl.lang import Value, arange, sum, where  # noqa: A004 - kd.sum


def pick(x: Value, j: int, axis: int) -> Value:
    """x[..., j, ...]: slice j of x along `axis`, without that axis (j a Python int). A sum over the axis of
    a tile that is zero but at j: when the axis lies within one thread, as a reshaped tile's last axis
    does, the selection folds away in the compiled code. Integer tiles stay integers (bit patterns, e.g.
    packed words, pass through unchanged)."""
    ax = axis % len(x.shape)
    if not 0 <= j < x.shape[ax]:
        raise dsl_error(f"kd.pick: index {j} outside axis {axis} of size {x.shape[ax]}")
    index = arange(0, x.shape[ax])[tuple(slice(None) if i == ax else None for i in range(len(x.shape)))]
    return sum(where(index == j, x, 0.0 if is_float(x.dtype) else 0), axis=ax)


def halves(x: Value, axis: int):
    """(x[..., 0, ...], x[..., 1, ...]): the two slices of x along `axis`, which has size 2. With kd.reshape,
    this is how a kernel takes a tile's interleaved halves apart (e.g. the two members of rotary pairs)."""
    if x.shape[axis % len(x.shape)] != 2:
        raise dsl_error(f"kd.halves takes an axis of size 2, got {list(x.shape)} along axis {axis}")
    return pick(x, 0, axis), pick(x, 1, axis)
