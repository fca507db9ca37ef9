"""What the Triton and numba code generators share: naming values and walking statements in order.

Both emit one statement per IR node, in program order, with the kernel author's variable names where
tracing captured them (`t<N>` otherwise). Constants, tensor dims and scalar parameters are inlined.
"""

from __future__ import annotations

import keyword

from kilnx.dsl.ir import KernelIR, Node

INLINE = {"const", "dim", "param", "program_id"}


class Namer:
    def __init__(self, ir: KernelIR, reserved: set[str]):
        self.names: dict[int, str] = {}
        self.used = set(reserved)
        self.count = 0
        for n in ir.walk():
            self.name(n)

    def name(self, n: Node) -> str:
        if id(n) in self.names:
            return self.names[id(n)]
        base = n.name if n.name and n.name.isidentifier() and not keyword.iskeyword(n.name) else None
        if base is None:
            base = f"t{self.count}"
            self.count += 1
        cand, k = base, 1
        while cand in self.used:
            cand, k = f"{base}_{k}", k + 1
        self.used.add(cand)
        self.names[id(n)] = cand
        return cand


def param_names(ir: KernelIR):
    """Kernel parameter list: each tensor as pointer, shape dims and strides; scalars by name."""
    out = []
    for p in ir.params + [o[0] for o in ir.outputs]:
        if hasattr(p, "ndim"):
            out.append(f"{p.name}_ptr")
            out += [f"{p.name}_shape{i}" for i in range(p.ndim)]
            out += [f"{p.name}_stride{i}" for i in range(p.ndim)]
        else:
            out.append(p.name)
    return out


def py_literal(v) -> str:
    """A Python literal that both Triton's and numba's front ends accept (no bare inf/nan)."""
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return "float('nan')" if v != v else ("float('inf')" if v > 0 else "-float('inf')")
    return repr(v)


def const_literal(n: Node) -> str:
    v = n.arg
    if n.dtype == "bool":
        return repr(bool(v))
    if n.dtype.startswith("f"):
        f = float(v)
        if f != f:
            return "float('nan')"
        if f in (float("inf"), float("-inf")):
            return f"float('{f}')"
        return repr(f)
    return repr(int(v))


def live_nodes(ir: KernelIR, hints: bool = False, boxes: bool = False) -> set[int]:
    """Ids of nodes the kernel body needs: those reaching a store, an atomic or an accumulator update,
    and with `hints` (the GPU) also prefetches, the grid-dependency sync and barriers. Host-only arithmetic
    (grid sizes, output shapes) is left out of the generated kernel. With `boxes` (a backend reading
    kd.load_tile's box from its offsets) a box load needs only its offsets, not its index tiles."""
    live: set[int] = set()
    roots = ("store", "atomic_add", "assign") + (("prefetch", "grid_sync", "barrier", "launch_deps") if hints else ())
    stack = [n for n in ir.walk() if n.op in roots]
    loops = [n for n in ir.walk() if n.op == "range"]
    while stack:
        n = stack.pop()
        if id(n) in live:
            continue
        live.add(id(n))
        srcs = n.srcs[len(n.arg[5]):] if boxes and n.op == "load" and n.arg[5] is not None else n.srcs
        stack += [s for s in srcs if isinstance(s, Node)]
        if n.op != "range":
            # a live node inside a loop keeps the loop (and its bounds) alive
            stack += [lp for lp in loops if lp.arg is n.block]
    return live



class StatementEmitter:
    """Walks a kernel body in program order and emits one or more lines per live node; loops become
    Python `for` statements. Backends supply `ref` (how a node is named or inlined) and `stmts`."""

    live: set[int]

    def ref(self, n: Node) -> str:
        raise NotImplementedError

    def stmts(self, n: Node) -> list[str]:
        raise NotImplementedError

    def loop_header(self, n: Node, bounds: str) -> str:
        """The iterable of a `range` node's `for` statement (backends may add pipelining hints)."""
        return f"range({bounds})"

    def block(self, block, depth: int) -> list[str]:
        out, pad = [], "    " * depth
        for n in block.nodes:
            if n.op in INLINE or id(n) not in self.live:
                continue
            if n.op == "range":
                bounds = ", ".join(self.ref(x) for x in n.srcs)
                out.append(f"{pad}for {self.ref(n)} in {self.loop_header(n, bounds)}:")
                out += self.block(n.arg, depth + 1) or [f"{pad}    pass"]
                continue
            out += [pad + line for line in self.stmts(n)]
        return out
