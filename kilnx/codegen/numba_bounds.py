"""Tile-wide facts about index and mask tiles, for the numba lowering's unmasked fast path.

A load/store lane is guarded by bounds checks and masks; inside a loop nest those are per-element
branches (masked vector loads at best). Most tiles are whole: every lane of `k0 + kd.arange(0, BK)`
is below K except in the last block. For index tiles built from aranges and scalars by + - * // min
max, the range of values over the whole tile is two scalar expressions (lo, hi), so "every lane
passes" is one scalar test before the nest. The lowering emits the nest twice, without and with the
per-element checks, and picks one with that test (numba_gen.Gen.stmts).
"""

from __future__ import annotations

from kilnx.dsl.ir import INTS, Node
from kilnx.codegen.numba_plan import is_trivial_reshape

_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def interval(n: Node, scalar) -> tuple[str, str] | None:
    """(lo, hi) expressions bounding every element of the integer tile n, or None if unknown.
    `scalar(node)` gives the expression of a scalar node (the same for every element)."""
    if not n.shape:
        if n.dtype not in INTS:
            return None
        s = scalar(n)
        return s, s
    op, srcs = n.op, n.srcs
    if n.dtype not in INTS:
        return None
    if op == "arange":
        return str(n.arg[0]), str(n.arg[1] - 1)
    if op == "full":
        return str(int(n.arg)), str(int(n.arg))
    if op in ("expand", "broadcast") or (op == "reshape" and is_trivial_reshape(n)) \
            or (op == "cast" and srcs[0].dtype in INTS):
        return interval(srcs[0], scalar)
    if op not in ("add", "sub", "mul", "floordiv", "minimum", "maximum"):
        return None
    a, b = interval(srcs[0], scalar), interval(srcs[1], scalar)
    if a is None or b is None:
        return None
    if op == "add":
        return f"({a[0]} + {b[0]})", f"({a[1]} + {b[1]})"
    if op == "sub":
        return f"({a[0]} - {b[1]})", f"({a[1]} - {b[0]})"
    if op in ("minimum", "maximum"):
        f = "min" if op == "minimum" else "max"
        return f"{f}({a[0]}, {b[0]})", f"{f}({a[1]}, {b[1]})"
    c = _constant(srcs[1])
    if op == "floordiv":
        return (f"({a[0]} // {c})", f"({a[1]} // {c})") if c is not None and c > 0 else None
    if c is None:
        c, a = _constant(srcs[0]), b
    if c is None:
        return None
    return (f"({a[0]} * {c})", f"({a[1]} * {c})") if c >= 0 else (f"({a[1]} * {c})", f"({a[0]} * {c})")


def always_true(n: Node, scalar) -> str | None:
    """An expression that is true only if every element of the bool tile n is true, or None."""
    if n.op == "const":
        return "True" if n.arg else None
    if not n.shape:
        return scalar(n)
    if n.op in ("expand", "broadcast") or (n.op == "reshape" and is_trivial_reshape(n)):
        return always_true(n.srcs[0], scalar)
    if n.op == "and":
        a, b = always_true(n.srcs[0], scalar), always_true(n.srcs[1], scalar)
        return f"({a}) & ({b})" if a is not None and b is not None else None
    if n.op in _COMPARE:
        a, b = interval(n.srcs[0], scalar), interval(n.srcs[1], scalar)
        if a is None or b is None:
            return None
        if n.op in ("lt", "le"):
            return f"({a[1]} {_COMPARE[n.op]} {b[0]})"
        return f"({a[0]} {_COMPARE[n.op]} {b[1]})"
    return None


def in_bounds(index: Node, size: str, scalar) -> str | None:
    """An expression true only if every element of the index tile lies in [0, size)."""
    iv = interval(index, scalar)
    return None if iv is None else f"({iv[0]} >= 0) & ({iv[1]} < {size})"


def _constant(n: Node):
    while n.op in ("expand", "broadcast", "cast") and n.srcs:
        n = n.srcs[0]
    if n.op == "const" and n.dtype in INTS:
        return int(n.arg)
    if n.op == "full" and n.dtype in INTS:
        return int(n.arg)
    return None
