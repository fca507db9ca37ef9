"""Which tile values the numba lowering keeps in a buffer and which it recomputes inside the loops of
their consumers.

The CPU lowering (numba_gen) turns each tile node into explicit loops over its elements. A node is
either
- a **buffer**: a flat array of its elements, filled by its own loop nest at its place in program
  order (reductions, dots, accumulators, and values worth keeping), or
- **inline**: an expression evaluated per element inside the loop of each consumer (elementwise
  arithmetic, casts, loads, index math), so a chain like `(words >> 4 & 15).f32() * x` costs one
  pass and no temporaries, or
- an **alias**: a reshape whose elements are the same flat buffer read with another shape.

Inlining moves a node's evaluation to its consumer's place. That is only right when nothing the node
reads (an accumulator, or memory through a load) is written in between: `reads` tracks that, and a
node whose consumer comes after such a write is kept in a buffer instead.
"""

from __future__ import annotations

from kilnx.dsl import opdefs
from kilnx.dsl.ir import KernelIR, Node
from kilnx.codegen.source import INLINE, live_nodes

BUFFER, INLINED, ALIAS, STATEMENT = "buffer", "inline", "alias", "statement"
EFFECTS = ("store", "atomic_add", "assign")
# elementwise ops cheap enough to recompute in every consumer (index arithmetic, masks)
CHEAP_OPS = {"add", "sub", "mul", "and", "or", "xor", "shl", "shr", "lt", "le", "gt", "ge", "eq", "ne",
             "floordiv", "mod", "minimum", "maximum", "neg", "invert"}
CHEAP_COST = 6


def is_trivial_reshape(n: Node) -> bool:
    """A reshape/expand that only inserts or drops size-1 axes: element (i, j) maps without div/mod."""
    src = n.srcs[0]
    return [d for d in n.shape if d != 1] == [d for d in src.shape if d != 1]


class Plan:
    def __init__(self, ir: KernelIR):
        self.ir = ir
        self.live = live_nodes(ir)
        self.order = [n for n in ir.walk() if id(n) in self.live or n.op in INLINE]
        self.seq = {id(n): i for i, n in enumerate(self.order)}
        self.by_id = {id(n): n for n in self.order}
        self.users: dict[int, list[Node]] = {}
        for n in self.order:
            for s in n.srcs:
                if isinstance(s, Node):
                    self.users.setdefault(id(s), []).append(n)
        self.writes = [(self.seq[id(n)], _write_target(n)) for n in self.order if n.op in EFFECTS]
        self.needs_buffer = set()
        for n in self.order:
            if n.op == "dot":
                self.needs_buffer.update(id(s) for s in n.srcs)
            elif n.op in ("reshape", "expand") and n.shape and not is_trivial_reshape(n):
                self.needs_buffer.add(id(n.srcs[0]))
        self.kind: dict[int, str] = {}
        self.reads: dict[int, frozenset] = {}
        self.cost: dict[int, float] = {}
        self.alias_root: dict[int, Node] = {}
        self.roots: dict[int, set] = {}
        for n in self.order:            # sources first: what each value would read if inlined
            self._fixed_kind_and_reads(n)
        for n in reversed(self.order):  # consumers first: where each value would be evaluated
            if id(n) not in self.kind:
                self._decide(n)
        for n in self.order:
            if self.kind[id(n)] == ALIAS:
                self.alias_root[id(n)] = self.storage(n.srcs[0])

    # --- queries ------------------------------------------------------------------------------------
    def kind_of(self, n: Node) -> str:
        return self.kind[id(n)]

    def storage(self, n: Node) -> Node:
        """The node whose buffer holds n's elements (n itself, or an alias's root)."""
        return self.alias_root.get(id(n), n)

    # --- decisions ----------------------------------------------------------------------------------
    def _fixed_kind_and_reads(self, n: Node):
        """Kinds that do not depend on consumers, and for the others an upper bound of what they read
        (accumulators, tensors) if every inlinable source were inlined, with a cost estimate."""
        i = id(n)
        if n.op in INLINE:
            self.kind[i], self.reads[i], self.cost[i] = INLINED, frozenset(), 0
            return
        if n.op in EFFECTS or n.op == "range" or not n.shape:
            # scalars are plain local variables computed in place: copying them is free
            self.kind[i], self.reads[i], self.cost[i] = STATEMENT, frozenset(), 0
            return
        if n.op in ("var", "reduce", "dot"):
            self.kind[i], self.reads[i], self.cost[i] = BUFFER, frozenset(), 0
            return
        reads, cost = set(), 1.0
        for s in n.srcs:
            if s.op == "var":
                reads.add(("var", id(s)))
            reads |= self.reads[id(s)]
            cost += self.cost[id(s)]
        if n.op == "load":
            reads.add(("mem", n.arg[0]))
            cost = float("inf")
        elif n.op in opdefs.OPS and n.op not in CHEAP_OPS:
            cost = float("inf")
        self.reads[i], self.cost[i] = frozenset(reads), cost

    def _roots(self, n: Node) -> set:
        """The statements whose loops would evaluate n if it were inlined."""
        out = set()
        for u in self.users.get(id(n), []):
            out |= self.roots[id(u)] if self.kind[id(u)] in (INLINED, ALIAS) else {id(u)}
        return out

    def _decide(self, n: Node):
        i = id(n)
        roots = self.roots[i] = self._roots(n)
        if n.op in ("reshape", "expand") and not is_trivial_reshape(n):
            # a view of a buffer; of an accumulator, only until the accumulator is next updated
            self.kind[i] = BUFFER if self._hazard(n, roots) else ALIAS
            return
        users = self.users.get(i, [])
        if i in self.needs_buffer or self._hazard(n, roots):
            keep = True
        elif self.cost[i] <= CHEAP_COST:
            # index math and masks: recomputed wherever used, except across loop levels when it
            # reads something a loop updates
            keep = bool(self.reads[i]) and any(u.block is not n.block for u in users)
        else:
            # an expensive value is computed once: inlined only into the one loop nest that needs
            # it (several uses there share one evaluation), and not where that nest repeats it
            keep = (len(roots) != 1 or any(u.block is not n.block for u in users)
                    or any(_broadcasts(n, u) for u in users))
        self.kind[i] = BUFFER if keep else INLINED
        if keep:
            self.roots[i] = set()

    def _hazard(self, n: Node, roots: set) -> bool:
        """Would evaluating n where its roots run read something written since n's own place?"""
        reads = self.reads[id(n)]
        if not reads:
            return False
        here = self.seq[id(n)]
        for r in roots:
            root = self.by_id[r]
            if root.block is not n.block:
                return True
            there = self.seq[r]
            if any(here < at < there and target in reads for at, target in self.writes):
                return True
        return False


def _write_target(n: Node):
    return ("var", id(n.srcs[0])) if n.op == "assign" else ("mem", n.arg[0])


def _broadcasts(n: Node, user: Node) -> bool:
    """n has fewer elements than the loop of its user: inlined, it would be recomputed per repeat."""
    size = _numel(n.shape)
    return size < _numel(user.shape) if user.shape else False


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
