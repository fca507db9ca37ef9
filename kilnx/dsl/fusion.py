"""`@kd.fusion`: a row-wise function of tensors compiled to ONE tile kernel.

Rows lie along the last axis; leading axes are flattened. A 1-d operand is a per-channel vector
broadcast over rows. `kd.split(x, n)` views a row as n equal parts (e.g. `[gate | up]`).

Lowering (to the same IR as `@kd.kernel`): programs own ROWS rows. When the row fits in BLOCK_D
columns the kernel is persistent: every operand is loaded once and reductions are tile reductions.
Otherwise it loops over column chunks, one pass per reduction (each pass recomputes the elementwise
prefix of that reduction from the inputs, with earlier reductions' results in hand) and a last pass
that computes and stores the outputs.
"""

from __future__ import annotations

import inspect

import torch

from kilnx.dsl import lang
from kilnx.dsl.ir import DSLError, dsl_error, dtype_of
from kilnx.dsl.kernel import traced_source, KernelBase, _call_capturing_locals, _name_nodes
from kilnx.dsl.tunables import Space, choice, pow2

NEUTRAL = {"sum": 0.0, "max": float("-inf"), "min": float("inf"), "argmax": float("-inf")}


class RowInput:
    """A fusion operand: loads its current chunk of columns when first used."""

    def __init__(self, ctx: "_FusionTrace", index: int, t: lang.TensorArg, part: int = 0, parts: int = 1):
        self.ctx, self.index, self.t, self.part, self.parts = ctx, index, t, part, parts
        self._value = None

    @property
    def dtype(self) -> str:
        return self.t.dtype

    def value(self) -> lang.Value:
        if self._value is None:
            self._value = self.ctx.load(self)
        return self._value

    def __getattr__(self, name):
        return getattr(self.value(), name)

    def __bool__(self):
        return bool(self.value())


def _forward(op):
    def f(self, *a):
        return getattr(self.value(), op)(*a)
    return f


for _op in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
            "__rtruediv__", "__neg__", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__",
            "__pow__", "__abs__", "__getitem__"):
    setattr(RowInput, _op, _forward(_op))


def split(x, n: int):
    """View each row of a fusion operand as n equal parts: `gate, up = kd.split(gate_up, 2)`."""
    if not isinstance(x, RowInput) or x.parts != 1 or x._value is not None:
        raise dsl_error("kd.split applies to an unused fusion input, once")
    x.ctx.splits[x.index] = n
    return tuple(RowInput(x.ctx, x.index, x.t, p, n) for p in range(n))


class _StopPass(Exception):
    """Ends a reduction pass: the rest of the function is not needed for this reduction."""


class _FusionTrace:
    def __init__(self, rows, cols, colmask, width, c0, target_pass, finals, splits):
        self.rows, self.cols, self.colmask, self.width, self.c0 = rows, cols, colmask, width, c0
        self.target_pass, self.finals, self.splits = target_pass, finals, splits
        self.reductions: list[str] = []
        self.pending = None

    def load(self, inp: RowInput) -> lang.Value:
        t = inp.t
        if t.ndim == 1:
            cols = self.cols + inp.part * self.width if inp.parts > 1 else self.cols
            v = lang.load(t, cols, mask=self.colmask, check=False)
            return v[None, :]
        cols = self.cols[None, :] + (inp.part * self.width if inp.parts > 1 else 0)
        return lang.load(t, self.rows[:, None], cols, mask=self.colmask[None, :], check=(True, False))

    def reduce(self, kind: str, x: lang.Value, keepdims: bool, mean: bool):
        k = len(self.reductions)
        self.reductions.append((kind, mean))
        if self.target_pass is not None and k < self.target_pass:
            r = self.finals[k]
        elif self.target_pass is not None and k == self.target_pass:
            self.pending = (kind, x, mean)
            raise _StopPass
        else:
            masked = lang.where(self.colmask[None, :], x, NEUTRAL[kind]) if x.ndim == 2 else x
            r = _tile_reduce(kind, masked)
            if mean:
                r = r / self.width.to("f32")
        return r if keepdims else lang.reshape(r, (r.shape[0],))


def _tile_reduce(kind, x):
    return lang.raw_reduce(kind, x, axis=1, keepdims=True)


class FusionKernel(KernelBase):
    def __init__(self, fn):
        space = Space({"ROWS": pow2(1, 64, default=1), "BLOCK_D": pow2(64, 16384, default=1024),
                       "num_warps": choice(1, 2, 4, 8, 16, default=4)})
        super().__init__(fn.__name__, space, _fusion_key, None, None, lambda: traced_source(fn))
        self.fn = fn
        sig = inspect.signature(fn)
        self.positional = [p.name for p in sig.parameters.values()
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.keyword = {p.name: p for p in sig.parameters.values() if p.kind == p.KEYWORD_ONLY}
        self._constexprs = {k for k in self.keyword if self._is_constexpr(k)}

    def default_config(self, *args, **kw) -> dict:
        rows = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
        width = self._width(args, kw)
        n_rows = rows[0].numel() // rows[0].shape[-1] if rows else 1
        block = min(max(64, 1 << (width - 1).bit_length()), 16384)
        r = 1
        while n_rows >= 4 * 132 * r * 2 and r * block < 4096 and r < 64:
            r *= 2
        tile = r * block
        warps = 1 if tile <= 256 else 2 if tile <= 1024 else 4 if tile <= 2048 else 8 if tile <= 8192 else 16
        return self.space.validate({"ROWS": r, "BLOCK_D": block, "num_warps": warps})

    def _width(self, args, kw):
        splits = self._discover(args, kw)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                return a.shape[-1] // splits.get(i, 1)
        raise DSLError(f"{self.name}: needs at least one tensor")

    def _is_constexpr(self, k) -> bool:
        p = self.keyword.get(k)
        return p is not None and p.annotation in (lang.constexpr, "kd.constexpr", "constexpr")

    def _spec(self, config, args, kw, backend):
        # The lowering (persistent or looped) is chosen at trace time from the row width, so it is part
        # of what a compiled kernel is specialised on: without it a persistent kernel compiled for a
        # narrow row was reused for a wider one with the same config (columns past BLOCK_D unwritten).
        return super()._spec(config, args, kw, backend) + (config["BLOCK_D"] >= self._width(args, kw),)

    def _discover(self, args, kw) -> dict[int, int]:
        """Which inputs are split (a throwaway trace): the row width must be known before lowering."""
        if not hasattr(self, "_split_cache"):
            self._split_cache = {}
        sig = tuple((a.dim(), str(a.dtype)) if isinstance(a, torch.Tensor) else None for a in args)
        if sig not in self._split_cache:
            ir, ctx = self._trace_once({"ROWS": 1, "BLOCK_D": 64, "num_warps": 1}, args, kw, discover=True)
            self._split_cache[sig] = dict(ctx.splits)
        return self._split_cache[sig]

    def trace(self, config, args, kw):
        return self._trace_once(config, args, kw)[0]

    def _trace_once(self, config, args, kw, discover=False):
        if len(args) != len(self.positional):
            raise DSLError(f"{self.name} takes {len(self.positional)} tensors, got {len(args)}")
        splits = {} if discover else self._discover(args, kw)
        ROWS, BLOCK_D = config["ROWS"], config["BLOCK_D"]
        with lang.tracing(self.name) as b:
            tens = [lang.tensor_param(n, dtype_of(a.dtype), 2 if a.dim() >= 2 else 1)
                    for n, a in zip(self.positional, args)]
            scalars = {k: (v if self._is_constexpr(k) else lang.scalar_param(k, v)) for k, v in kw.items()}
            first = next((i for i, a in enumerate(args) if a.dim() >= 2), 0)
            lead = tens[first]
            width = lead.shape[-1] // splits.get(first, 1) if splits.get(first, 1) > 1 else lead.shape[-1]
            n_rows = lead.shape[0] if lead.ndim == 2 else 1
            pid = lang.grid(lang.cdiv(n_rows, ROWS))
            rows = pid * ROWS + lang.arange(0, ROWS)
            persistent = discover or BLOCK_D >= self._width(args, kw)
            kinds = [] if persistent else self._reduction_kinds(args, kw, config)
            n_red = len(kinds)
            finals, outputs, allocated = [], None, {}
            for p in range(n_red + 1):
                target = p if p < n_red else None
                if persistent:
                    cols = lang.arange(0, BLOCK_D)
                    ctx = _FusionTrace(rows, cols, cols < width, width, 0, None, finals, splits)
                    outputs, names = self._call(ctx, tens, scalars)
                    self._store(ctx, outputs, tens, first, allocated)
                    break
                acc = self._new_accumulator(kinds[p], ROWS) if target is not None else None
                for c0 in lang.range(0, width, BLOCK_D):
                    cols = c0 + lang.arange(0, BLOCK_D)
                    ctx = _FusionTrace(rows, cols, cols < width, width, c0, p, finals, splits)
                    if target is None:
                        outputs, names = self._call(ctx, tens, scalars)
                        self._store(ctx, outputs, tens, first, allocated)
                    else:
                        try:
                            self._call(ctx, tens, scalars)
                        except _StopPass:
                            self._accumulate(ctx, acc)
                if target is not None:
                    finals.append(self._finalize(acc, width))
            ir = b.ir
        if not discover:
            _name_nodes(names)
        ir.num_warps = config.get("num_warps", 4)
        return ir, ctx

    def _reduction_kinds(self, args, kw, config):
        _, ctx = self._trace_once({**config, "BLOCK_D": 1 << 30}, args, kw, discover=True)
        return ctx.reductions

    @staticmethod
    def _new_accumulator(kind_mean, ROWS):
        kind, mean = kind_mean
        if kind == "argmax":
            return (lang.var(lang.full((ROWS, 1), float("-inf"), "f32")), lang.var(lang.full((ROWS, 1), 0, "i32")))
        return [lang.var(lang.full((ROWS, 1), NEUTRAL[kind], "f32")), kind, mean]

    def _call(self, ctx, tens, scalars):
        inputs = [RowInput(ctx, i, t) for i, t in enumerate(tens)]
        prev = getattr(lang._state, "fusion", None)
        lang._state.fusion = ctx
        try:
            out, names = _call_capturing_locals(self.fn, inputs, scalars)
        finally:
            lang._state.fusion = prev
        outs = out if isinstance(out, tuple) else (out,)
        outs = tuple(o.value() if isinstance(o, RowInput) else o for o in outs)
        if not all(isinstance(o, lang.Value) for o in outs):
            raise DSLError(f"{self.name} must return traced values (one or a tuple)")
        return outs, names

    def _accumulate(self, ctx, acc):
        kind, x, mean = ctx.pending
        xm = lang.where(ctx.colmask[None, :], x, NEUTRAL[kind]) if x.ndim == 2 else x
        xm = xm.to("f32")
        if kind == "argmax":
            val, idx = acc
            m = lang.raw_reduce("max", xm, axis=1, keepdims=True)
            i = lang.raw_reduce("argmax", xm, axis=1, keepdims=True) + ctx.c0
            upd = m > val  # strict: the first maximum wins, as in numpy
            idx.set(lang.where(upd, i, idx))
            val.set(lang.where(upd, m, val))
            return
        v = acc[0]
        part = lang.raw_reduce(kind, xm, axis=1, keepdims=True)
        v.set(v + part if kind == "sum" else (lang.maximum(v, part) if kind == "max" else lang.minimum(v, part)))

    def _finalize(self, acc, width):
        if isinstance(acc, tuple):
            return acc[1]
        v, kind, mean = acc
        return v / width.to("f32") if mean else v

    def _store(self, ctx, outputs, tens, first, allocated: dict):
        """Store each returned value: row tiles into (rows, width) outputs, per-row values into (rows,).
        Outputs are allocated on first use and reused by later chunks (`allocated`: name -> tensor)."""
        lead = tens[first]
        n_rows = lead.shape[0] if lead.ndim == 2 else 1
        names = []
        for k, v in enumerate(outputs):
            name = f"out{k}"
            names.append(name)
            rowwise = v.ndim == 2 and v.shape[1] != 1
            if name not in allocated:
                shape = (n_rows, ctx.width) if rowwise else (n_rows,)
                allocated[name] = lang.output(shape, v.dtype, name=name)
            t = allocated[name]
            if rowwise:
                lang.store(t, ctx.rows[:, None], ctx.cols[None, :], v,
                           mask=ctx.colmask[None, :], check=(True, False))
            else:
                flat = lang.reshape(v, (v.shape[0],)) if v.ndim == 2 else v
                lang.store(t, ctx.rows, flat)
        lang.builder().ir.returns = tuple(names) if len(names) > 1 else names[0]

    # --- protocol ---------------------------------------------------------------------------------
    def _build(self, config, args, kw, backend):
        from kilnx.codegen import launch as L
        ir = self.trace(config, args, kw)
        header = f"{self.name}: config {config}"
        if backend == "triton":
            from kilnx.codegen.triton_gen import generate
            fn = getattr(L.load_module(generate(ir, header=header, interpret=L.interpreting()), self.name), self.name)
        elif backend == "numba":
            from kilnx.codegen.numba_gen import generate
            fn = L.load_module(generate(ir, header=header), self.name + "_numba")
        elif backend == "reference":
            fn = None
        else:
            raise DSLError(f"unknown backend {backend!r}")
        return L.Launch(ir, backend, None, fn)

    def _run(self, launch, args, kw):
        lead = next((a for a in args if a.dim() >= 2), args[0])
        # rows are the flattened leading dims; 2-d operands (the common case) pass through as they are
        tensors = {n: (a.reshape(-1, a.shape[-1]) if a.dim() > 2 else a) for n, a in zip(self.positional, args)}
        n_rows = None
        for n, t in tensors.items():
            if t.dim() == 2:
                if n_rows is None:
                    n_rows = t.shape[0]
                elif t.shape[0] != n_rows:
                    raise DSLError(f"{self.name}: operand {n} has {t.shape[0]} rows, expected {n_rows}")
        scalars = {k: v for k, v in kw.items() if k not in self._constexprs}
        res = launch(tensors, scalars)
        if lead.dim() == 2:
            return res
        lead_shape = lead.shape[:-1]
        res_t = res if isinstance(res, tuple) else (res,)
        shaped = tuple(r.reshape(*lead_shape, r.shape[-1]) if r.dim() == 2 else r.reshape(lead_shape) for r in res_t)
        return shaped if isinstance(res, tuple) else shaped[0]

    def _prepared(self, launch, args, kw):
        # only where _run would pass every operand through unchanged: 2-d rows (or 1-d vectors)
        # with a 2-d leading operand, so the results need no reshape either
        if any(a.dim() > 2 for a in args) or not any(a.dim() == 2 for a in args):
            return None
        if len({a.shape[0] for a in args if a.dim() == 2}) > 1:
            return None
        return super()._prepared(launch, args, kw)

    def triton_source(self, *args, config=None, **kw) -> str:
        from kilnx.codegen.triton_gen import generate
        config = self.space.validate(config) if config is not None else self.default_config(*args, **kw)
        return generate(self.trace(config, args, kw), header=f"{self.name}: config {config}")


def _fusion_key(*args, **kw):
    rows = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
    n = rows[0].numel() // rows[0].shape[-1] if rows else 1
    bucket = 1 << (max(n, 1) - 1).bit_length()
    width = rows[0].shape[-1] if rows else args[0].shape[-1]
    return {"rows": bucket, "D": width, "dtype": str(args[0].dtype).replace("torch.", "")}


def fusion(fn):
    return FusionKernel(fn)
