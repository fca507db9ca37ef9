"""The one IR under `@kd.kernel` and `@kd.fusion`.

A kernel is a list of instructions in program order (`Block`), each a `Node(op, dtype, shape, srcs,
arg)`. Shapes are static tile shapes (tuples of ints; `()` is a scalar). Runtime sizes (tensor dims)
are scalar nodes. Loops own a nested Block. Mutable accumulators are `var` nodes: a later `assign`
rebinds them, and any node that lists the var as a source reads its value *at that point in program
order* — so every backend can emit nodes one by one, in order, as statements.
"""

from __future__ import annotations

import os
import sys
import linecache
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# ---- dtypes ------------------------------------------------------------------------------------
FLOATS = ("f8e4", "f16", "bf16", "f32", "f64")
SMALL_FLOATS = ("f8e4", "f16", "bf16")   # held in fp32 registers on the CPU backends, rounded to their precision
INTS = ("i8", "u8", "i16", "i32", "u32", "i64")
DTYPES = FLOATS + INTS + ("bool",)
ITEMSIZE = {"f8e4": 1, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "i8": 1, "u8": 1, "i16": 2, "i32": 4, "u32": 4, "i64": 8,
            "bool": 1}

_TORCH_NAMES = {
    "float8_e4m3fn": "f8e4", "float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64", "int8": "i8",
    "uint8": "u8", "int16": "i16", "int32": "i32", "uint32": "u32", "int64": "i64", "bool": "bool",
}
NUMPY_OF = {"f8e4": np.float32, "f16": np.float32, "bf16": np.float32, "f32": np.float32, "f64": np.float64,
            "i8": np.int8, "u8": np.uint8, "i16": np.int16, "i32": np.int32, "u32": np.uint32,
            "i64": np.int64, "bool": np.bool_}
"""Register (in-kernel) numpy type per dtype for the CPU backends: 16-bit floats are held in fp32
after rounding to their precision, since numpy/numba have no bf16 arithmetic (fp8 e4m3 likewise: storage
for KV caches, loaded and converted, never computed in)."""


def dtype_of(d) -> str:
    """Normalise a torch dtype, a kilnx dtype name or a numpy dtype to a kilnx dtype name."""
    if isinstance(d, str):
        if d in DTYPES:
            return d
        raise TypeError(f"unknown dtype {d!r}; use one of {DTYPES}")
    name = str(d).replace("torch.", "")
    if name in _TORCH_NAMES:
        return _TORCH_NAMES[name]
    raise TypeError(f"unsupported dtype {d!r}")


def torch_dtype(d: str):
    import torch
    return {"f8e4": torch.float8_e4m3fn, "f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32, "f64": torch.float64,
            "i8": torch.int8, "u8": torch.uint8, "i16": torch.int16, "i32": torch.int32,
            "u32": torch.uint32, "i64": torch.int64, "bool": torch.bool}[d]


def is_float(d: str) -> bool:
    return d in FLOATS


def promote(a: str, b: str) -> str:
    """Result dtype of a binary op (Triton's rules, simplified): floats win, wider wins."""
    if a == b:
        return a
    if is_float(a) or is_float(b):
        fa = [x for x in (a, b) if is_float(x)]
        if len(fa) == 1:
            return fa[0]
        if "f64" in fa:
            return "f64"
        return "f32"  # f16 with bf16, or either with f32
    if "bool" in (a, b):
        return b if a == "bool" else a
    order = ["i8", "u8", "i16", "i32", "u32", "i64"]
    return max(a, b, key=order.index)


class DSLError(Exception):
    """A kernel-authoring mistake, reported at the author's line."""


_DSL_DIR = os.path.dirname(os.path.abspath(__file__))
_inside_dsl: dict = {}   # code object -> whether it is kilnx's DSL machinery


def _author_frame():
    """The innermost frame outside kilnx's DSL machinery (the kernel author's), by walking frames:
    tracing records one per IR node, and traceback.extract_stack (which reads every frame's source
    line) cost a second of a cold start's first-token time."""
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        inside = _inside_dsl.get(code)
        if inside is None:
            inside = _inside_dsl[code] = os.path.abspath(code.co_filename).startswith(_DSL_DIR)
        if not inside:
            return f
        f = f.f_back
    return None


def node_location() -> str:
    """file:line of the kernel author's line, cheap enough for every traced node."""
    f = _author_frame()
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "<unknown>"


def with_source(loc: str) -> str:
    """A node's file:line with the source text of that line appended (for error messages)."""
    path, _, line = loc.rpartition(":")
    text = linecache.getline(path, int(line)).strip() if line.isdigit() else ""
    return f"{loc}: {text}" if text else loc


def user_location() -> str:
    """file:line: source of the kernel author's line (for error messages)."""
    f = _author_frame()
    if f is None:
        return "<unknown>"
    line = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
    return f"{f.f_code.co_filename}:{f.f_lineno}: {line}"


def dsl_error(msg: str) -> DSLError:
    return DSLError(f"{msg}\n  at {user_location()}")


# ---- nodes -------------------------------------------------------------------------------------
@dataclass(eq=False)
class Node:
    op: str
    dtype: str
    shape: tuple
    srcs: tuple = ()
    arg: Any = None
    name: str | None = None
    block: "Block | None" = field(default=None, repr=False)
    loc: str = field(default="", repr=False)

    def __hash__(self):
        return id(self)


@dataclass(eq=False)
class Block:
    nodes: list = field(default_factory=list)
    parent: "Block | None" = None
    # a loop body's software-pipelining depth (None: the backend's default); Triton stages the loop's
    # loads through shared memory this many iterations ahead, other backends run the loop as written
    stages: "int | None" = None
    # a loop nest the backend may run as one loop (Triton's flatten): a persistent kernel's loop over its
    # tiles and their K loop pipelined as one, so the next tile's loads overlap this tile's epilogue
    flatten: bool = False

    def encloses(self, other: "Block") -> bool:
        b = other
        while b is not None:
            if b is self:
                return True
            b = b.parent
        return False


@dataclass(frozen=True)
class TensorParam:
    """A tensor argument: name, dtype, rank; its shape and strides are runtime scalars."""
    name: str
    dtype: str
    ndim: int


@dataclass(frozen=True)
class ScalarParam:
    name: str
    dtype: str  # "f32" for Python floats, "i64" for ints


@dataclass
class KernelIR:
    name: str
    params: list                      # TensorParam | ScalarParam, in call order
    body: Block
    grid: tuple = ()                  # scalar nodes (host-evaluated) giving the launch grid
    outputs: list = field(default_factory=list)  # (TensorParam, shape nodes, init) allocated on host
    returns: Any = None               # which output params are returned: name or tuple of names
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None
    uses_atomics: bool = False
    tile_tensors: set = field(default_factory=set)   # tensors read by kd.load_tile (TMA rules at launch)

    def walk(self, block: Block | None = None):
        """Every node in program order, descending into loops."""
        for n in (block or self.body).nodes:
            yield n
            if n.op == "range":
                yield from self.walk(n.arg)


def fmt_ir(ir: KernelIR) -> str:
    """A readable dump of the IR (for debugging and error messages)."""
    names: dict[int, str] = {}

    def nm(n):
        return names.setdefault(id(n), n.name or f"%{len(names)}")

    lines = [f"kernel {ir.name}({', '.join(p.name for p in ir.params)})"]

    def dump(block, depth):
        for n in block.nodes:
            srcs = ", ".join(nm(s) if isinstance(s, Node) else repr(s) for s in n.srcs)
            arg = "" if n.op == "range" or n.arg is None else f" [{n.arg!r}]"
            lines.append(f"{'  ' * depth}{nm(n)}: {n.dtype}{list(n.shape)} = {n.op}({srcs}){arg}")
            if n.op == "range":
                dump(n.arg, depth + 1)
    dump(ir.body, 1)
    return "\n".join(lines)


def broadcast_shapes(*shapes: tuple) -> tuple:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise dsl_error(f"shapes {' and '.join(str(list(s)) for s in shapes)} do not broadcast") from None


sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))
