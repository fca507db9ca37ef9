"""Run a traced kernel: allocate its outputs, evaluate its grid, and launch it on a backend.

Backends: "triton" (GPU, or the Triton interpreter under TRITON_INTERPRET=1), "numba" (CPU),
"reference" (the numpy interpreter). Generated modules are written under the kilnx cache directory,
keyed by the hash of their source, so a second process imports them without regenerating; Triton and
numba keep their own compiled-binary caches beside them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from kilnx.cache.location import cache_root, write_atomically
from kilnx.dsl.ir import KernelIR, TensorParam, torch_dtype
# attributes of these modules are read at call time: they import kilnx.dsl, which imports this module
from kilnx.codegen import numba_launch, reference

BACKENDS = ("triton", "numba", "reference")
_lock = threading.Lock()
_modules: dict[str, object] = {}


def cache_dir() -> Path:
    p = cache_root() / "kernels"
    p.mkdir(parents=True, exist_ok=True)
    return p


# os.environ's own mapping (keys encoded, bytes on POSIX): every kernel call asks, so the lookup skips
# os.environ's per-call key encoding; tests flip the variable at run time, so it is never cached
_ENVIRON = getattr(os.environ, "_data", None) if hasattr(os.environ, "encodekey") else None
_INTERPRET = os.environ.encodekey("TRITON_INTERPRET") if _ENVIRON is not None else None
_ONE = os.environ.encodevalue("1") if _ENVIRON is not None else None


def interpreting() -> bool:
    """Whether TRITON_INTERPRET=1 now: Triton kernels on CPU tensors run in Triton's interpreter."""
    if _ENVIRON is not None:
        return _ENVIRON.get(_INTERPRET) == _ONE
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def load_module(source: str, prefix: str):
    """Import generated source from a file named by its hash (Triton's jit needs a real file)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    name = f"kilnx_gen_{prefix}_{digest}"
    with _lock:
        if name in _modules:
            return _modules[name]
        path = cache_dir() / f"{name}.py"
        if not path.exists() or path.read_text() != source:
            write_atomically(path, source)  # concurrent processes never import half a file
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        _modules[name] = mod
        return mod


@functools.lru_cache(maxsize=None)
def _pdl() -> bool:
    from kilnx.codegen.triton_rt import pdl_enabled
    return pdl_enabled()


_warming = threading.Event()
_warm_thread: threading.Thread | None = None


def warm_up_in_background(device) -> None:
    """Start, on a daemon thread, the one-time work of a GPU process's first kernel calls, so that it
    overlaps loading the weights: Triton's own cache key (remembered on disk, kilnx/codegen/triton_key.py;
    hashing it took 0.4 s on an H200 host) and the tuned configs for this device (from their snapshot,
    kilnx/cache/snapshot.py, or the DB). On the H200 the thread took 0.9 s before both were remembered,
    and the first launch waited for it (bench/probes/cold_phases.py). Errors are left for the first real
    call to raise, where they are reported."""
    if torch.device(device).type != "cuda" or _warming.is_set():
        return
    global _warm_thread
    _warming.set()
    _warm_thread = threading.Thread(target=_warm, args=(torch.device(device).index or 0,), daemon=True,
                                    name="kilnx-warm-up")
    _warm_thread.start()


def _join_warm_up() -> None:
    """The first GPU launch waits for the warm-up rather than redoing its work beside it (Triton's key
    is memoized without a lock: measured, both threads hashed)."""
    global _warm_thread
    t, _warm_thread = _warm_thread, None
    if t is not None:
        t.join()


def _warm(index: int) -> None:
    try:
        from kilnx.codegen import triton_key
        triton_key.install()
        from kilnx.runtime.dispatch import _device_info, get_tuned
        get_tuned(_device_info("cuda", index))
    except Exception:  # noqa: BLE001 - the first kernel call repeats this and reports what failed
        pass


def default_backend(tensors) -> str:
    devs = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if "cuda" in devs:
        return "triton"
    return "triton" if interpreting() else "numba"


class Launch:
    """One compiled specialization: call it with the kernel's tensors and runtime scalars."""

    def __init__(self, ir: KernelIR, backend: str, source: str | None, fn):
        self.ir, self.backend, self.source, self.fn = ir, backend, source, fn
        self.tensor_params = [p for p in ir.params if isinstance(p, TensorParam)]
        self._plans: dict = {}
        if backend == "numba":
            self._numba = numba_launch._NumbaLaunch(ir, fn)

    def prepared(self, tensors: dict, scalars: dict, arg_index: dict):
        """A call for these exact shapes, strides and scalars taking only the positional arguments
        (their addresses change from call to call), or None where the backend has none."""
        if self.backend == "numba":
            return self._numba.prepared(self, tensors, scalars, arg_index)
        if self.backend == "triton" and os.environ.get("KILNX_PREPARED_LAUNCH", "1") != "0":
            return _TritonCall.make(self, tensors, scalars, arg_index)
        return None

    def host_eval(self, node, tensors: dict, scalars: dict) -> int:
        fake = {k: numba_launch._ShapeOnly(v.shape) for k, v in tensors.items()}
        return reference.Interpreter(self.ir, fake, scalars).eval_host(node)

    def _plan(self, tensors: dict, scalars: dict) -> tuple[list, tuple]:
        """(output shapes, grid) of a call: host expressions of the argument shapes and scalars, evaluated
        once per distinct shapes and scalars (interpreting them took ~35 of the ~50 us a launch cost the host
        before Triton's own launcher, measured on 2 EPYC cores; an eager prefill pays it per kernel per layer)."""
        key = (tuple(tuple(t.shape) for t in tensors.values()), tuple(scalars.items()))
        try:
            plan = self._plans.get(key)
        except TypeError:               # an unhashable scalar: evaluate every time
            key, plan = None, None
        if plan is None:
            shapes = [[self.host_eval(s, tensors, scalars) for s in shape_nodes]
                      for _, shape_nodes, _ in self.ir.outputs]
            with_outs = {**tensors, **{p.name: numba_launch._ShapeOnly(shape)
                                       for (p, _, _), shape in zip(self.ir.outputs, shapes)}}
            grid = tuple(self.host_eval(g, with_outs, scalars) for g in self.ir.grid) or (1,)
            plan = (shapes, grid)
            if key is not None:
                if len(self._plans) >= 256:     # prefill lengths vary: keep the memo small
                    self._plans.clear()
                self._plans[key] = plan
        return plan

    def __call__(self, tensors: dict, scalars: dict):
        if self.backend == "numba":
            return self._numba(self, tensors, scalars)
        if numba_launch._recorder is not None:
            numba_launch._recorder.refuse(f"{self.ir.name} runs on the {self.backend} backend")
        device = next((t.device for t in tensors.values()), torch.device("cpu"))
        shapes, grid = self._plan(tensors, scalars)
        outs = {}
        for (p, _, zero), shape in zip(self.ir.outputs, shapes):
            alloc = torch.zeros if zero else torch.empty
            outs[p.name] = alloc(shape, dtype=torch_dtype(p.dtype), device=device)
        allt = {**tensors, **outs}
        if min(grid) > 0:
            getattr(self, f"_run_{self.backend}")(allt, scalars, grid)
        return self.returns(outs)

    def returns(self, outs: dict):
        if self.ir.returns is None:
            return None
        if isinstance(self.ir.returns, tuple):
            return tuple(outs[r] for r in self.ir.returns)
        return outs[self.ir.returns]

    def _flat_args(self, allt, scalars, convert, slots: dict | None = None):
        """The kernel's arguments in order: each tensor followed by its shape and strides, each scalar;
        `slots`, where given, receives each tensor's position in the list."""
        args = []
        for p in self.ir.params + [o[0] for o in self.ir.outputs]:
            if isinstance(p, TensorParam):
                t = allt[p.name]
                if slots is not None:
                    slots[p.name] = len(args)
                args.append(convert(t))
                args += list(t.shape) + list(t.stride())
            else:
                args.append(scalars[p.name])
        return args

    def _run_triton(self, allt, scalars, grid):
        if _warm_thread is not None:
            _join_warm_up()
        if self.ir.tile_tensors:
            _ready_for_tma(self.ir, allt)
        args = self._flat_args(allt, scalars, lambda t: t)
        self.fn[grid](*args, **self.triton_options(next(iter(allt.values())).is_cuda))

    def triton_options(self, cuda: bool) -> dict:
        """The launch's keyword options: warps, stages, the register cap, PDL (on a GPU that has it)."""
        knobs = {"num_warps": self.ir.num_warps, "num_stages": self.ir.num_stages}
        if self.ir.maxnreg:
            knobs["maxnreg"] = self.ir.maxnreg
        if cuda and _pdl():
            knobs["launch_pdl"] = True
        return knobs

    def _run_reference(self, allt, scalars, grid):
        arrays = {name: _to_numpy(t) for name, t in allt.items()}
        reference.Interpreter(self.ir, arrays, scalars).run(grid)
        written = {n.arg[0] for n in self.ir.walk() if n.op in ("store", "atomic_add")}
        for name in written:
            t = allt[name]
            src = arrays[name]
            if t.dtype == torch.uint32:
                src = src.view(np.int32)
                t.copy_(torch.from_numpy(src).view(torch.uint32).to(t.device))
            else:
                t.copy_(torch.from_numpy(np.ascontiguousarray(src)).to(t.dtype).to(t.device))


class _TritonCall:
    """One Triton kernel call with everything but the tensors decided: the argument list (shapes, strides
    and scalars are fixed by the call key this belongs to), the outputs' shapes, the grid and the launch
    options. Eager prefill launches every kernel of every layer from Python, and the host sets its pace on a
    slower machine (llama-3.1-8b at 2048 tokens: 26.7k tok/s there against 38k, session 18); the general
    path re-derives all of this per call. KILNX_PREPARED_LAUNCH=0 keeps every call on the general path."""

    @classmethod
    def make(cls, launch: Launch, tensors: dict, scalars: dict, arg_index: dict) -> "_TritonCall | None":
        shapes, grid = launch._plan(tensors, scalars)
        if min(grid) <= 0:
            return None            # nothing to launch: the general path returns the empty outputs
        return cls(launch, tensors, scalars, arg_index, shapes, grid)

    def __init__(self, launch: Launch, tensors: dict, scalars: dict, arg_index: dict, shapes, grid):
        ir = launch.ir
        self.launch, self.grid = launch, grid
        self.device = next((t.device for t in tensors.values()), torch.device("cpu"))
        # meta tensors stand in for the outputs: they give the list their shapes and contiguous strides
        outs = {p.name: torch.empty(shape, dtype=torch_dtype(p.dtype), device="meta")
                for (p, _, _), shape in zip(ir.outputs, shapes)}
        self.slots: dict[str, int] = {}
        # every tensor slot is filled per call: the template holds none (the first call's weights would stay alive
        # with it after their model is gone)
        self.template = launch._flat_args({**tensors, **outs}, scalars, lambda t: None, self.slots)
        self.inputs = [(self.slots[name], arg_index[name]) for name in tensors]
        self.outs = [(self.slots[p.name], p.name, outs[p.name].shape, outs[p.name].dtype, zero)
                     for p, _, zero in ir.outputs]
        self.knobs = launch.triton_options(self.device.type == "cuda")

    def __call__(self, args):
        ir = self.launch.ir
        if numba_launch._recorder is not None:
            numba_launch._recorder.refuse(f"{ir.name} runs on the triton backend")
        if _warm_thread is not None:
            _join_warm_up()
        a = self.template.copy()
        for slot, i in self.inputs:
            a[slot] = args[i]
        outs = {}
        for slot, name, shape, dtype, zero in self.outs:
            outs[name] = a[slot] = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=self.device)
        if ir.tile_tensors:   # TMA's rules include the addresses: checked per call
            _ready_for_tma(ir, {name: a[slot] for name, slot in self.slots.items()})
        self.launch.fn[self.grid](*a, **self.knobs)
        return self.launch.returns(outs)


def tma_readable(t: torch.Tensor) -> bool:
    """Whether TMA can read t as kd.load_tile does: last dim contiguous, address and other strides in
    16-byte multiples. Kernels that may see other layouts ask it to pick a kd.load path instead."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride()[:-1])


_tma_scratch = threading.local()


def _ready_for_tma(ir: KernelIR, allt: dict) -> None:
    """TMA's rules for the tensors kd.load_tile reads, one clear error each; and the scratch allocator
    that Triton writes in-kernel descriptors to (Triton keeps it per thread: set once in each)."""
    for name in ir.tile_tensors:
        t = allt[name]
        if not tma_readable(t):
            raise ValueError(f"{ir.name}: `{name}` (shape {tuple(t.shape)}, strides {t.stride()}) cannot be read "
                             "by kd.load_tile: TMA needs the last dim contiguous and the address and other strides "
                             "multiples of 16 bytes; pass a contiguous copy, or route such inputs to a kd.load path")
    if not getattr(_tma_scratch, "set", False):
        import triton
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=_scratch_device()))
        _tma_scratch.set = True


def _scratch_device():
    """Where Triton launches: the current CUDA device, or the CPU under the interpreter."""
    if interpreting() or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A private numpy copy in the interpreter's register types (16-bit floats held as fp32)."""
    a = t.detach().cpu()
    if a.dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        return a.float().numpy().copy()
    if a.dtype == torch.uint32:
        return a.view(torch.int32).numpy().view(np.uint32).copy()
    return a.numpy().copy()
