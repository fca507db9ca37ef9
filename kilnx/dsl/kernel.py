"""`@kd.kernel`: a traced tile-level kernel, and the protocol every kilnx kernel object follows.

The protocol (shared with `@kd.fusion`, used alike by the tuner and the runtime):
`.name`, `.space`, `.source_hash`, `.key(*args, **kw)`, `.default_config(*args, **kw)`,
`.compile(config, *args, backend=None, **kw)` -> callable, `.reference(*args, **kw)`,
`.triton_source(*args, config=None, **kw)`, and for tuning `.make_args(problem, device)` and
`.sample_problems()`.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import weakref
from typing import Any, Callable

import torch

from kilnx.codegen import launch as _launch
from kilnx.dsl import lang
from kilnx.dsl.ir import DSLError, KernelIR, dsl_error, dtype_of, fmt_ir
from kilnx.dsl.tunables import Space, Tunable

CODEGEN_VERSION = "1"  # bump when a lowering changes what a kernel computes or how fast it runs
LAUNCH_KNOBS = ("num_warps", "num_stages", "maxnreg")   # maxnreg: registers per thread, capped (0: the compiler's)


MAX_REMEMBERED_CALLS = 1024
_SIMPLE = (int, float, str, bool, type(None))
_tuning_generation = [0]
"""Bumped when the runtime reloads tuned configs: kernels then forget which launch each call got."""


def forget_remembered_configs() -> None:
    _tuning_generation[0] += 1


class PerObjectMemo:
    """Answers remembered per (objects, key) until tuned configs reload: what a hot path (a decode
    step's hundred qmatmul calls) would otherwise decide again on every call. The objects (weights)
    are held weakly and checked on a hit, so a freed object's reused id never answers for another; an
    answer goes when one of its objects does (an answer may hold tensors: a served call keeps a view of
    its weight, or a repacked copy, which would otherwise outlive the model)."""

    MISSING = object()

    def __init__(self, limit: int | None = 4096, *, generational: bool = True):
        """limit: entries kept before all are dropped (None: no limit); generational: answers hold only until
        tuned configs reload (False: for as long as their objects live)."""
        self._store: dict = {}
        self._limit = limit
        self._generational = generational

    def _entry(self, objs: tuple, key) -> tuple:
        return tuple(map(id, objs)), key, _tuning_generation[0] if self._generational else None

    def get(self, objs: tuple, key):
        hit = self._store.get(self._entry(objs, key))
        if hit is not None and all(ref() is o for ref, o in zip(hit[0], objs)):
            return hit[1]
        return self.MISSING

    def put(self, objs: tuple, key, value):
        if self._limit is not None and len(self._store) >= self._limit:
            self._store.clear()
        entry = self._entry(objs, key)
        store = self._store

        def forget(ref):
            hit = store.get(entry)
            if hit is not None and any(r is ref for r in hit[0]):
                del store[entry]
        store[entry] = (tuple(weakref.ref(o, forget) for o in objs), value)
        return value

    def clear(self):
        self._store.clear()


def _call_key(args, backend, kw):
    """What decides a call's config and specialization, or None when an argument is not hashable."""
    # the default backend follows TRITON_INTERPRET, which tests flip at run time
    key = [backend or _launch.interpreting()]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.get_device()))   # get_device: -1 on the CPU
        elif isinstance(a, _SIMPLE):
            key.append(a)
        else:
            return None
    for k, v in kw.items():
        if not isinstance(v, _SIMPLE):
            return None
        key.append((k, v))
    return tuple(key)


def format_key(d: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in d.items())


def combined_source_hash(version: str, kernels) -> str:
    """A route's hash: its version and the hashes of the kernels it chooses between (ask it lazily, as a kernel's own
    hash is: the helpers below a kernel exist only once its module has run)."""
    return hashlib.sha256((version + "".join(k.source_hash for k in kernels)).encode()).hexdigest()


class Route:
    """A choice between kernels with the kernel protocol (its tunable is the choice; kilnx/kernels/routing.py).
    Subclasses set `version` and `chosen_between()`; the source hash combines them when first asked."""

    version = "0"
    peer = None

    def chosen_between(self) -> tuple:
        raise NotImplementedError

    @property
    def source_hash(self) -> str:
        if getattr(self, "_hash", None) is None:
            self._hash = combined_source_hash(self.version, self.chosen_between())
        return self._hash


def _names_used(code) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:   # comprehensions and nested functions are code objects of their own
        if inspect.iscode(c):
            names |= _names_used(c)
    return names


def traced_source(fn) -> str:
    """The source of `fn` and of every helper it calls from its own module or the kernel library,
    recursively: functions, classes (their methods) and helper modules used as `module.name` (whole).
    Tuned configs are keyed by this text's hash: a change in a helper that a kernel traces (e.g. how
    codes are decoded) must make its stored configs stale."""
    own = fn.__module__
    seen: set = set()
    parts: list[str] = []

    def ours(obj) -> bool:
        mod = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", "") or ""
        return mod == own or mod.startswith("kilnx.kernels")

    def visit(obj):
        if obj in seen or not ours(obj):
            return
        seen.add(obj)
        try:
            parts.append(inspect.getsource(obj))
        except (OSError, TypeError):   # no source to read (e.g. made by exec): nothing to add
            return
        if inspect.isclass(obj):
            for member in vars(obj).values():
                if inspect.isfunction(member):
                    visit(member)
        elif inspect.isfunction(obj):
            for name in sorted(_names_used(obj.__code__)):
                used = obj.__globals__.get(name)
                if inspect.isfunction(used) or inspect.isclass(used) or inspect.ismodule(used):
                    visit(used)
                elif isinstance(used, dict):    # a table of helpers by name (the MoE epilogues' activations)
                    for value in used.values():
                        if inspect.isfunction(value):
                            visit(value)
    visit(fn)
    return "\n".join(parts)


class KernelBase:
    """What tile kernels and fusions share: tunables, keys, dispatch, the compiled-spec cache."""

    name: str
    space: Space

    def __init__(self, name, space, key_fn, default_fn, spec_fn, source: Callable[[], str], specialize=None):
        self.name, self.space = name, space
        self._specialize = specialize
        self._key_fn, self._default_fn, self._spec_fn = key_fn, default_fn, spec_fn
        # read when first asked, not at decoration: helpers defined below the kernel in its module (a common
        # order) are not in its globals yet when the decorator runs, and their text would be missed
        self._source, self._source_hash = source, None
        self._compiled: dict = {}
        self._calls: dict = {}
        self.make_args: Callable | None = None
        self._problems: list[dict] = []
        self.peer: Callable | None = None
        self._finish: Callable | None = None
        self._finished_reference: Callable | None = None
        self._finished_values: Callable | None = None

    @property
    def source_hash(self) -> str:
        """sha256 of the codegen version and the kernel's traced source (traced_source: its function and the
        helpers it reaches). Tuned configs are keyed by it."""
        if self._source_hash is None:
            self._source_hash = hashlib.sha256((CODEGEN_VERSION + self._source()).encode()).hexdigest()
        return self._source_hash

    def _with_specialization(self, args, kw) -> dict:
        """Compile-time values derived from the arguments (e.g. bit width from packed shapes)."""
        if self._specialize is None:
            return kw
        return {**self._specialize(*args), **kw}

    # --- protocol ---------------------------------------------------------------------------------
    def key(self, *args, **kw) -> str:
        if self._key_fn is None:
            shapes = {f"a{i}": "x".join(map(str, a.shape)) for i, a in enumerate(args)
                      if isinstance(a, torch.Tensor)}
            return format_key(shapes)
        k = self._key_fn(*args, **self._with_specialization(args, kw))
        return k if isinstance(k, str) else format_key(k)

    def default_config(self, *args, **kw) -> dict:
        cfg = self.space.default()
        if self._default_fn is not None:
            cfg.update(self._default_fn(*args, **self._with_specialization(args, kw)))
        return self.space.validate(cfg)

    def sample_problems(self) -> list[dict]:
        return list(self._problems)

    def tuning(self, *, make_args: Callable, problems: list[dict], peer: Callable | None = None,
               finish: Callable | None = None, finished_reference: Callable | None = None,
               finished_values: Callable | None = None):
        """Declare how the tuner makes inputs for a problem (a dict of sizes) and which sizes to tune.

        finish(outputs, *args), with finished_reference(*args): for a kernel whose own outputs depend on a tunable
        (the split decode attention's partial results on its keys per range), the step that makes them independent
        of it (the merge). The tuner then checks and times the kernel followed by `finish` against
        finished_reference, not the kernel alone against its spec (which holds for one config only). Time the
        finish the runtime runs (its cost can decide the winner); where that one writes another form than the
        reference's (the prepared merge), finished_values(finished, *args) maps it to the reference's for the
        check, untimed."""
        if (finish is None) != (finished_reference is None):
            raise ValueError(f"{self.name}.tuning: finish and finished_reference go together")
        if finished_values is not None and finish is None:
            raise ValueError(f"{self.name}.tuning: finished_values needs a finish")
        self.make_args, self._problems, self.peer = make_args, list(problems), peer
        self._finish, self._finished_reference = finish, finished_reference
        self._finished_values = finished_values
        return self

    def tuning_call(self, config: dict | None, *args):
        """What a tuning trial checks and times: the kernel on `config`, then its `finish` where declared. The call
        carries `finished_values` where declared: the gate maps its outputs through it before comparing them."""
        fn = self.compile(config, *args)
        if self._finish is None:
            return fn
        finish = self._finish

        def finished(*a):
            return finish(fn(*a), *a)
        finished.finished_values = self._finished_values
        return finished

    def tuning_reference(self, *args):
        """The outputs a tuning trial must match: finished_reference where declared, else the spec's."""
        if self._finished_reference is None:
            return self.reference(*args)
        return self._finished_reference(*args)

    def compile(self, config: dict | None, *args, backend: str | None = None, **kw):
        launch = self._launch(config, args, kw, backend)
        return lambda *a, **k: self._run(launch, a, self._with_specialization(a, k))

    def _launch(self, config: dict | None, args, kw, backend):
        from kilnx.codegen.launch import default_backend
        kw = self._with_specialization(args, kw)
        config = self.space.validate(config or {}) if config is not None else self.default_config(*args, **kw)
        backend = backend or default_backend(args)
        spec = self._spec(config, args, kw, backend)
        if spec not in self._compiled:
            self._compiled[spec] = self._build(config, args, kw, backend)
        return self._compiled[spec]

    def __call__(self, *args, backend: str | None = None, config: dict | None = None, **kw):
        if config is not None or backend == "reference":
            return self.compile(config, *args, backend=backend, **kw)(*args, **kw)
        # A decode step calls each kernel hundreds of times with the same shapes: remember, per
        # (shapes, strides, dtypes, devices, keyword values), the launch its tuned config chose, and
        # where the backend allows, a call with everything but the tensors' addresses prepared. Until
        # the runtime reloads tuned configs.
        key = _call_key(args, backend, kw)
        hit = self._calls.get(key) if key is not None else None
        if hit is None or hit[0] != _tuning_generation[0]:
            launch = self._launch(self._tuned_config(args, kw), args, kw, backend)
            spec = self._specialize(*args) if self._specialize else {}
            fast = self._prepared(launch, args, {**spec, **kw}) if key is not None else None
            hit = (_tuning_generation[0], launch, spec, fast)
            if key is not None:
                if len(self._calls) >= MAX_REMEMBERED_CALLS:
                    self._calls.clear()
                self._calls[key] = hit
        if hit[3] is not None:
            return hit[3](args)
        return self._run(hit[1], args, {**hit[2], **kw} if hit[2] else kw)

    def _prepared(self, launch, args, kw):
        """A function of the positional tensors alone for calls of this key, or None (backend
        without one, or arguments that need the general path)."""
        tensors, scalars = self._operands(args, kw)
        return launch.prepared(tensors, scalars, {n: i for i, n in enumerate(self.positional)})

    def _operands(self, args, kw) -> tuple[dict, dict]:
        """(tensors by name, runtime scalars by name) of a call: what a launch takes."""
        tensors = {n: a for n, a in zip(self.positional, args) if a is not None}
        return tensors, {k: v for k, v in kw.items() if k not in self._constexprs}

    def reference(self, *args, **kw):
        """The numpy-defined result: the kernel's spec function, else the IR interpreted in numpy."""
        if self._spec_fn is not None:
            return self._spec_fn(*args, **self._with_specialization(args, kw))
        return self.compile(self.default_config(*args, **kw), *args, backend="reference", **kw)(*args, **kw)

    def _tuned_config(self, args, kw) -> dict:
        try:
            from kilnx.runtime.dispatch import config_for
        except ImportError:
            return self.default_config(*args, **kw)
        return config_for(self, args, kw)

    def _spec(self, config, args, kw, backend):
        sig = tuple((a.dtype, a.dim()) if isinstance(a, torch.Tensor) else (type(a).__name__, a)
                    if not isinstance(a, (int, float)) else type(a).__name__ for a in args)
        kws = tuple(sorted((k, self._kw_spec(k, v)) for k, v in kw.items()))
        return (backend, tuple(sorted(config.items())), sig, kws)

    def _kw_spec(self, k, v):
        return v if self._is_constexpr(k) else type(v).__name__

    def _is_constexpr(self, k) -> bool:
        return True

    def _run(self, launch, args, kw):
        raise NotImplementedError


class TileKernel(KernelBase):
    def __init__(self, fn, space: Space, key_fn, default_fn, spec_fn, specialize=None):
        super().__init__(fn.__name__, space, key_fn, default_fn, spec_fn, lambda: traced_source(fn), specialize)
        self.fn = fn
        self.sig = inspect.signature(fn)
        self.positional = [p.name for p in self.sig.parameters.values()
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.keyword = {p.name: p for p in self.sig.parameters.values() if p.kind == p.KEYWORD_ONLY}
        self._constexprs = {k for k in self.keyword if self._is_constexpr(k)}
        for t in space.params:
            if t not in self.keyword and t not in LAUNCH_KNOBS:
                raise dsl_error(f"@kd.kernel {self.name}: tunable {t!r} is not a keyword-only parameter of "
                               f"the function (declare `*, {t}` in its signature)")

    def _is_constexpr(self, k) -> bool:
        p = self.keyword.get(k)
        return p is not None and p.annotation in (lang.constexpr, "kd.constexpr", "constexpr")

    def trace(self, config: dict, args, kw) -> KernelIR:
        kw = self._with_specialization(args, kw)
        if len(args) != len(self.positional):
            raise DSLError(f"{self.name} takes {len(self.positional)} tensors ({', '.join(self.positional)}), "
                           f"got {len(args)}")
        unknown = set(kw) - set(self.keyword)
        if unknown:
            raise DSLError(f"{self.name}: unknown keyword arguments {sorted(unknown)}")
        with lang.tracing(self.name) as b:
            targs = []
            for name, a in zip(self.positional, args):
                if a is None:
                    targs.append(None)
                elif isinstance(a, torch.Tensor):
                    targs.append(lang.tensor_param(name, dtype_of(a.dtype), a.dim()))
                else:
                    raise DSLError(f"{self.name}: positional argument {name} must be a tensor or None, "
                                   f"got {type(a).__name__}")
            kwargs = {}
            for name, p in self.keyword.items():
                if name in self.space.params:
                    kwargs[name] = config[name]
                elif name in kw:
                    kwargs[name] = kw[name] if self._is_constexpr(name) else lang.scalar_param(name, kw[name])
                elif p.default is not inspect.Parameter.empty:
                    kwargs[name] = p.default
                else:
                    raise DSLError(f"{self.name}: missing keyword argument {name!r}")
            result, local_names = _call_capturing_locals(self.fn, targs, kwargs)
            ir = b.ir
        if not ir.grid:
            raise DSLError(f"@kd.kernel {self.name} never called kd.grid(...) to declare its launch grid")
        _name_nodes(local_names)
        if result is None:
            ir.returns = None
        elif isinstance(result, lang.TensorArg):
            ir.returns = result.param.name
        elif isinstance(result, tuple) and all(isinstance(r, lang.TensorArg) for r in result):
            ir.returns = tuple(r.param.name for r in result)
        else:
            raise DSLError(f"{self.name} must return None, a kd.output or a tuple of them")
        ir.num_warps = config.get("num_warps", 4)
        ir.num_stages = config.get("num_stages", 2)
        ir.maxnreg = config.get("maxnreg") or None
        ir.constexprs = dict(config)
        return ir

    def _build(self, config, args, kw, backend):
        from kilnx.codegen import launch as L
        ir = self.trace(config, args, kw)
        header = f"{self.name}: config {config}"
        if backend == "triton":
            from kilnx.codegen.triton_gen import generate
            src = generate(ir, header=header, interpret=L.interpreting())
            fn = getattr(L.load_module(src, self.name), self.name)
        elif backend == "numba":
            from kilnx.codegen.numba_gen import generate
            src = generate(ir, header=header)
            fn = L.load_module(src, self.name + "_numba")   # the Launch picks its entry points
        elif backend == "reference":
            src, fn = None, None
        else:
            raise DSLError(f"unknown backend {backend!r}; use one of {L.BACKENDS}")
        return L.Launch(ir, backend, src, fn)

    def _run(self, launch, args, kw):
        return launch(*self._operands(args, kw))

    def triton_source(self, *args, config: dict | None = None, **kw) -> str:
        from kilnx.codegen.triton_gen import generate
        config = self.space.validate(config) if config is not None else self.default_config(*args, **kw)
        return generate(self.trace(config, args, kw), header=f"{self.name}: config {config}")

    def ir_dump(self, *args, config=None, **kw) -> str:
        config = self.space.validate(config) if config is not None else self.default_config(*args, **kw)
        return fmt_ir(self.trace(config, args, kw))


def _call_capturing_locals(fn, args, kwargs):
    """Call fn while capturing its locals at return, so generated code keeps the author's names."""
    captured: dict[str, Any] = {}
    code = fn.__code__

    def prof(frame, event, arg):
        if event == "return" and frame.f_code is code:
            captured.update(frame.f_locals)

    old = sys.getprofile()
    if old is not None and not callable(old):
        # a C-level profiler (cProfile on Python 3.11) is installed: setprofile would silence it and could
        # not put it back; trace without the author's names (generated names only differ in the source)
        return fn(*args, **kwargs), captured
    sys.setprofile(prof)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(old)
    return result, captured


def _name_nodes(local_names: dict):
    for name, v in local_names.items():
        if isinstance(v, lang.Value) and v.node.name is None and v.node.op not in ("const", "dim", "param"):
            v.node.name = name


def kernel(fn=None, *, tune: dict[str, Tunable] | Space | None = None, key=None, default=None,
           constraints=(), spec=None, specialize=None):
    """Define a tile-level kernel. `tune`: name -> kd.pow2/choice/... (or a Space); `key`: args ->
    dict of sizes naming the shape bucket; `default`: args -> partial config overriding defaults;
    `spec`: args -> expected output (the kernel's meaning, used by tests and the tuner's gate);
    `specialize`: args -> compile-time keyword values derived from shapes (each value compiles apart)."""
    def wrap(f):
        space = tune if isinstance(tune, Space) else Space(dict(tune or {}), tuple(constraints))
        return TileKernel(f, space, key, default, spec, specialize)
    return wrap(fn) if fn is not None else wrap
