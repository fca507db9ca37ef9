"""The CPU launch path: numba-compiled kernels called with tensor addresses, and the recorder that
replays a decode step's launches (runtime/engine.py). Split from launch.py, which owns the backends'
common entry (`Launch`)."""

from __future__ import annotations

import functools
import math
import os
import threading
import time

import numpy as np
import torch

from kilnx.dsl.ir import DSLError, KernelIR, TensorParam, torch_dtype


class _NumbaLaunch:
    """The CPU launch path, kept lean: a decode step makes hundreds of kernel calls, so output shapes
    and the grid are evaluated once per distinct input shape, and tensors go to the compiled code as
    addresses with their shapes and strides (no numpy views)."""

    MAX_LAYOUTS = 4096

    def __init__(self, ir: KernelIR, module):
        self.ir = ir
        self.programs = getattr(module, f"{ir.name}_programs")
        self.parallel = getattr(module, f"{ir.name}_parallel")
        self.params = [(p.name, isinstance(p, TensorParam), getattr(p, "dtype", None)) for p in ir.params]
        self.tensor_names = [p.name for p in ir.params if isinstance(p, TensorParam)]
        self.outputs = [(p.name, torch_dtype(p.dtype), zero) for p, _, zero in ir.outputs]
        self.written = {n.arg[0] for n in ir.walk() if n.op in ("store", "atomic_add")}
        host_nodes = list(ir.grid) + [s for _, shape, _ in ir.outputs for s in shape]
        self.host_scalars = sorted({n.arg for n in _reachable(host_nodes) if n.op == "param"})
        self.layouts: dict = {}
        self.serial = ir.uses_atomics   # atomics are plain read-modify-writes: one thread, in order
        _numba()

    def layout(self, launch: Launch, tensors: dict, scalars: dict, key) -> "_Layout":
        """Everything about a call that its input shapes and strides decide, computed once per key:
        output shapes, the grid, and the argument list with only addresses and scalars left to fill."""
        shapes = [[launch.host_eval(s, tensors, scalars) for s in shape] for _, shape, _ in self.ir.outputs]
        fake = {**tensors, **{name: _ShapeOnly(shape) for (name, _, _), shape in zip(self.outputs, shapes)}}
        grid = tuple(launch.host_eval(g, fake, scalars) for g in self.ir.grid) or (1,)
        lay = _Layout(grid + (1,) * (3 - len(grid)))
        for name, is_tensor, dtype in self.params:
            if not is_tensor:
                lay.scalars.append((len(lay.args), name, float if dtype == "f32" else int))
                lay.args.append(0)
                continue
            t = tensors[name]
            shape, stride = list(t.shape), list(t.stride())
            if shape and stride[-1] != 1 and shape[-1] != 1:
                # the generated code assumes unit stride along the last dim (contiguous vector access)
                lay.copies.append(name)
                stride = [math.prod(shape[d + 1:]) for d in range(len(shape))]
            lay.inputs.append((len(lay.args), name))
            lay.args += [0] + shape + stride
        for (name, dtype, zero), shape in zip(self.outputs, shapes):
            lay.outs.append((len(lay.args), name, shape, dtype, torch.zeros if zero else torch.empty))
            lay.args += [0] + shape + [math.prod(shape[d + 1:]) for d in range(len(shape))]
        if key is not None:
            if len(self.layouts) >= self.MAX_LAYOUTS:
                self.layouts.clear()
            self.layouts[key] = lay
        return lay

    def __call__(self, launch: Launch, tensors: dict, scalars: dict):
        key = (tuple([(t.shape, t.stride()) for t in tensors.values()]),
               tuple([scalars[k] for k in self.host_scalars]))
        lay = self.layouts.get(key) or self.layout(launch, tensors, scalars, key)
        args = lay.args.copy()
        back = []
        for slot, name in lay.inputs:
            t = tensors[name]
            if t.is_cuda:
                raise DSLError("the numba backend runs on CPU tensors; move them with .cpu() or use backend='triton'")
            if lay.copies and name in lay.copies:
                c = t.contiguous()
                if name in self.written:
                    back.append((t, c))
                t = c
            args[slot] = t.data_ptr()
        for slot, name, kind in lay.scalars:
            args[slot] = kind(scalars[name])
        outs = {}
        for slot, name, shape, dtype, alloc in lay.outs:
            o = outs[name] = alloc(shape, dtype=dtype)
            args[slot] = o.data_ptr()
        if _recorder is not None:
            if lay.copies:   # a replay would not redo the contiguous copies of strided operands
                _recorder.refuse(f"{self.ir.name} copies a strided operand")
            _recorder.launch(self, lay, args, list(tensors.values()) + list(outs.values()),
                             [outs[name] for _, name, _, _, alloc in lay.outs if alloc is torch.zeros])
        self.run(lay, args)
        for t, c in back:
            t.copy_(c)
        return launch.returns(outs)

    def run(self, lay: "_Layout", args: list):
        g0, g1, g2 = lay.grid
        total = g0 * g1 * g2
        if total <= 0:
            return
        threads = numba_threads() if total > 1 and not self.serial else 1
        if threads == 1:
            self.programs(0, total, g0, g1, *args)
        elif lay.mode.choose() == 0:
            self.programs(0, total, g0, g1, *args)
            lay.mode.done()
        else:
            with _parallel_lock:   # numba's workqueue layer runs one parallel region at a time
                self.parallel(min(total, threads), g0, g1, g2, *args)
            lay.mode.done()

    def prepared(self, launch: Launch, tensors: dict, scalars: dict, arg_index: dict):
        ts = [t for t in tensors.values() if t is not None]
        if any(t.is_cuda for t in ts) or any(t.dim() and t.stride(-1) != 1 and t.shape[-1] != 1 for t in ts):
            return None   # the general path checks the device and copies strided operands
        if any(o[1] not in _NUMPY_STORAGE for o in self.outputs):
            return None
        tensors = {k: t for k, t in tensors.items() if t is not None}
        lay = self.layout(launch, tensors, scalars, key=None)
        for slot, name, kind in lay.scalars:
            lay.args[slot] = kind(scalars[name])
        return _PreparedCall(self, lay, arg_index, self.ir.returns)


# outputs are numpy allocations seen by torch: in a decode step, where the weights streamed through
# the caches evict the host code between kernels, np.empty + from_numpy cost half of torch.empty
_NUMPY_STORAGE = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
                  torch.int32: np.int32, torch.int64: np.int64, torch.int16: np.int16, torch.int8: np.int8,
                  torch.uint8: np.uint8, torch.bool: np.bool_, torch.bfloat16: np.uint16, torch.float8_e4m3fn: np.uint8,
                  torch.uint32: np.uint32}


class _PreparedCall:
    """One kernel call with everything but the input addresses decided (see Launch.prepared)."""

    def __init__(self, numba_launch: "_NumbaLaunch", lay: "_Layout", arg_index: dict, returns):
        self.launch, self.lay = numba_launch, lay
        self.template = list(lay.args)
        self.ptrs = [(slot, arg_index[name]) for slot, name in lay.inputs]
        self.outs = [(slot, name, tuple(shape), _NUMPY_STORAGE[dtype], dtype if dtype in (torch.bfloat16, torch.float8_e4m3fn) else None,
                      alloc is torch.zeros) for slot, name, shape, dtype, alloc in lay.outs]
        self.returns = returns

    def __call__(self, args):
        a = self.template.copy()
        for slot, i in self.ptrs:
            a[slot] = args[i].data_ptr()
        outs = {}
        for slot, name, shape, np_dtype, view, zero in self.outs:
            o = torch.from_numpy((np.zeros if zero else np.empty)(shape, np_dtype))
            if view is not None:
                o = o.view(view)
            outs[name] = o
            a[slot] = o.data_ptr()
        if _recorder is not None:
            _recorder.launch(self.launch, self.lay, a, list(args) + list(outs.values()),
                             [outs[o[1]] for o in self.outs if o[5]])
        self.launch.run(self.lay, a)
        r = self.returns
        if r is None:
            return None
        return tuple(outs[n] for n in r) if isinstance(r, tuple) else outs[r]


class Recorder:
    """The numba launches of a stretch of host code, recorded to be replayed with the same addresses.

    A CPU decode step is a few hundred kernel calls whose Python dispatch (argument checks, memo
    lookups, output allocation) cost ~8 ms of a ~27 ms SmolLM2-135M step; its launches are the same every
    step but for the data. `replay()` reruns the recorded launches (outputs zeroed where the kernel asks)
    over the same tensors, which the recorder keeps alive: like a CUDA graph, it is right only if every
    write of the recorded code is a kernel's and its inputs live in the same tensors at replay (the
    engine checks the torch calls of the recorded step; runtime/engine.py)."""

    def __init__(self):
        self.steps: list = []      # (numba launch, layout, arguments, tensors to zero first)
        self.keep: list = []       # every tensor a recorded launch reads or writes
        self.refused: list[str] = []

    def launch(self, numba_launch, lay, args, tensors, zeroed):
        self.steps.append((numba_launch, lay, list(args), zeroed))
        self.keep += tensors

    def refuse(self, why: str):
        self.refused.append(why)

    def __enter__(self):
        global _recorder
        if _recorder is not None:
            raise RuntimeError("kernel launches are already being recorded")
        _recorder = self
        return self

    def __exit__(self, *exc):
        global _recorder
        _recorder = None

    def replay(self):
        for numba_launch, lay, args, zeroed in self.steps:
            for t in zeroed:
                t.zero_()
            numba_launch.run(lay, args)


_recorder: Recorder | None = None


class _LaunchMode:
    """Serial or parallel, chosen per call layout by timing both.

    Waking numba's workers costs tens of microseconds, and on a machine whose other core is busy a
    parallel region waits for the slower thread, so only some kernels gain from threads (a GEMV over
    3072 rows does, a 1-row norm never does). Each layout runs PROBES calls each way, keeps the faster,
    and probes again every REPROBE calls, since what other processes run changes."""

    PROBES, REPROBE = 3, 2000

    def __init__(self):
        self.calls, self.best, self.mode, self.current, self.t0 = 0, [float("inf")] * 2, 0, 0, 0.0

    def choose(self) -> int:
        """0 serial, 1 parallel."""
        probing = self.calls % self.REPROBE < 2 * self.PROBES
        self.current = self.calls % 2 if probing else self.mode
        if probing and self.calls % self.REPROBE == 0:
            self.best = [float("inf"), float("inf")]
        self.t0 = time.perf_counter() if probing else 0.0
        return self.current

    def done(self):
        if self.t0:
            self.best[self.current] = min(self.best[self.current], time.perf_counter() - self.t0)
            if self.calls % self.REPROBE == 2 * self.PROBES - 1:
                self.mode = 0 if self.best[0] <= self.best[1] else 1
        self.calls += 1


class _Layout:
    def __init__(self, grid):
        self.grid = grid
        self.mode = _LaunchMode()
        self.args: list = []          # the kernel's arguments, addresses and scalars as 0
        self.inputs: list = []        # (slot, tensor name)
        self.scalars: list = []       # (slot, name, float | int)
        self.outs: list = []          # (slot, name, shape, torch dtype, torch.empty | torch.zeros)
        self.copies: list = []        # inputs passed as contiguous copies (last stride not 1)


_parallel_lock = threading.Lock()


def numba_threads() -> int:
    return _numba().get_num_threads()


def numba_threads_set(n: int) -> None:
    """Threads the CPU kernels split their programs over (at most numba's NUMBA_NUM_THREADS)."""
    numba = _numba()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


@functools.lru_cache(maxsize=None)
def _numba():
    """numba, configured for the generated kernels (before any of them compiles or launches).

    - SLP vectorization on (numba turns it off by default since miscompilations with older LLVMs):
      tile loops along a short contiguous dim (8-32 elements) are fully unrolled by LLVM and only the
      SLP vectorizer packs them into vector instructions; without it a 4-bit GEMV ran 3-5x slower.
      Every kernel is checked against the numpy reference in the tests, which is what guards this.
    - The workqueue threading layer unless the user chose one: OpenMP's workers spin after every
      parallel region, and on a few cores that spinning competes with torch's own OpenMP pool and the
      next kernel (a 3-program attention call ran 5x slower on 2 threads than on 1); workqueue
      workers sleep. Kernels launch one parallel region at a time (_parallel_lock)."""
    os.environ.setdefault("NUMBA_SLP_VECTORIZE", "1")
    if not os.environ.get("NUMBA_THREADING_LAYER"):
        os.environ["NUMBA_THREADING_LAYER"] = "workqueue"
    import numba
    numba.config.SLP_VECTORIZE = int(os.environ["NUMBA_SLP_VECTORIZE"])
    numba.config.THREADING_LAYER = os.environ["NUMBA_THREADING_LAYER"]
    return numba


def _reachable(nodes):
    seen, stack = {}, list(nodes)
    while stack:
        n = stack.pop()
        if id(n) not in seen:
            seen[id(n)] = n
            stack += [s for s in n.srcs if hasattr(s, "srcs")]
    return seen.values()


class _ShapeOnly:
    def __init__(self, shape):
        self.shape = tuple(shape)
        self.ndim = len(shape)
