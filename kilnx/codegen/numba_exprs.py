"""The numba lowering's expression helpers: register-type casts, storage conversions, flat indices, and the
loop nest that places each subexpression at the outermost loop depth where its variables are defined."""

from __future__ import annotations

import math
import re

from kilnx.dsl.ir import NUMPY_OF, SMALL_FLOATS

NP = {d: f"np.{t.__name__}" for d, t in NUMPY_OF.items()}
STORE_NP = {**NP, "f8e4": "np.uint8", "f16": "np.uint16", "bf16": "np.uint16", "bool": "np.uint8"}
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def wrap(expr: str, dtype: str) -> str:
    """An expression of the register type of `dtype` (numba widens small ints; 8/16-bit floats round)."""
    if dtype == "bool":
        return expr
    if dtype in SMALL_FLOATS:
        return f"_rt.round_{dtype}(np.float32({expr}))"
    return f"{NP[dtype]}({expr})"


def convert(expr: str, src: str, dst: str) -> str:
    """A value cast between register types, with the reference's semantics."""
    if src == dst or (src in SMALL_FLOATS and dst == "f32"):
        return expr
    if dst == "bool":
        return f"({expr} != 0)"
    return wrap(expr, dst)


class Nest:
    """A loop nest being emitted: `for` loops over index variables, the statements of the innermost
    body, and named subexpressions ("temps"), each placed at the outermost depth where every loop
    variable it reads is defined. Identical subexpressions share one temp: index math repeated in
    a load's offset and mask is computed once, and what does not depend on an inner loop is hoisted
    out of it. Every expression the lowering builds is pure (loads carry their own mask), so it may
    run earlier or unconditionally."""

    def __init__(self, gen, loops):
        self.gen, self.loops = gen, list(loops)        # [(variable, range arguments)]
        self.level = {v: d + 1 for d, (v, _) in enumerate(self.loops)}
        self.pre = [[] for _ in range(len(self.loops) + 1)]    # lines at depth d, before loop d
        self.post = [[] for _ in range(len(self.loops) + 1)]   # lines at depth d, after loop d
        self.memo: dict[str, str] = {}

    def depth(self, text: str) -> int:
        return max([self.level.get(w, 0) or self.gen.temp_depth.get(w, 0) for w in _IDENT.findall(text)],
                   default=0)

    def bind(self, text: str) -> str:
        if "(" not in text:
            return text
        name = self.memo.get(text)
        if name is None:
            self.gen.counter += 1
            name = self.memo[text] = f"_x{self.gen.counter}"
            d = self.depth(text)
            self.gen.temp_depth[name] = d
            self.pre[d].append(f"{name} = {text}")
        return name

    def lines(self) -> list[str]:
        out: list[str] = []
        for d in range(len(self.loops), -1, -1):
            inner = self.pre[d] + out + self.post[d]
            if d == 0:
                return inner
            v, args = self.loops[d - 1]
            out = [f"for {v} in range({args}):"] + ["    " + x for x in (inner or ["pass"])]
        return out


def _buffer_dtype(dtype: str) -> str:
    """Tile buffers hold register values: 8/16-bit floats as fp32, bools as bytes."""
    return "f32" if dtype in SMALL_FLOATS else dtype


def _from_storage(expr: str, dtype: str) -> str:
    if dtype in SMALL_FLOATS:
        return f"_rt.{dtype}_bits_to_f32({expr})"
    if dtype == "bool":
        return f"({expr} != 0)"
    return expr


def _to_storage(expr: str, dtype: str) -> str:
    if dtype in SMALL_FLOATS:
        return f"_rt.f32_to_{dtype}_bits({expr})"
    return f"{STORE_NP[dtype]}({expr})"


def _linear(idx, shape) -> str:
    terms = []
    for d, i in enumerate(idx):
        if i == "0" or shape[d] == 1:
            continue
        stride = math.prod(shape[d + 1:])
        terms.append(i if stride == 1 else f"{i} * {stride}")
    return " + ".join(terms) or "0"


def _bcast(idx, shape, src_shape):
    """Index of a source element under right-aligned broadcasting."""
    if not src_shape:
        return []
    lead = len(shape) - len(src_shape)
    return [("0" if s == 1 else idx[lead + d]) for d, s in enumerate(src_shape)]
