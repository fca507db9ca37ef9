"""Run a traced kernel: allocate its outputs, evaluate its grid, and launch it on a backend.

Backends: "triton" (GPU, or the Triton interpreter under TRITON_INTERPRET=1), "numba" (CPU),
"reference" (the numpy interpreter). Generated modules are written under the kilnx cache directory,
keyed by the hash of their source, so a second process imports them without regenerating; Triton and
numba keep their own compiled-binary caches beside them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from kilnx.dsl.ir import DSLError, KernelIR, TensorParam, torch_dtype
from kilnx.codegen.reference import Interpreter

BACKENDS = ("triton", "numba", "reference")
_lock = threading.Lock()
_modules: dict[str, object] = {}


def cache_dir() -> Path:
    root = os.environ.get("KILNX_CACHE_DIR")
    if root:
        p = Path(root)
    else:
        import platformdirs
        p = Path(platformdirs.user_cache_dir("kilnx"))
    p = p / "kernels"
    p.mkdir(parents=True, exist_ok=True)
    return p


def interpreting() -> bool:
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
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(source)
            os.replace(tmp, path)  # atomic: concurrent processes never import half a file
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        _modules[name] = mod
        return mod


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

    def host_eval(self, node, tensors: dict, scalars: dict) -> int:
        fake = {k: _ShapeOnly(v.shape) for k, v in tensors.items()}
        return Interpreter(self.ir, fake, scalars).eval_host(node)

    def __call__(self, tensors: dict, scalars: dict):
        device = next((t.device for t in tensors.values()), torch.device("cpu"))
        outs = {}
        for p, shape_nodes, zero in self.ir.outputs:
            shape = [self.host_eval(s, tensors, scalars) for s in shape_nodes]
            alloc = torch.zeros if zero else torch.empty
            outs[p.name] = alloc(shape, dtype=torch_dtype(p.dtype), device=device)
        allt = {**tensors, **outs}
        grid = tuple(self.host_eval(g, allt, scalars) for g in self.ir.grid) or (1,)
        if min(grid) > 0:
            getattr(self, f"_run_{self.backend}")(allt, scalars, grid)
        if self.ir.returns is None:
            return None
        if isinstance(self.ir.returns, tuple):
            return tuple(outs[r] for r in self.ir.returns)
        return outs[self.ir.returns]

    def _flat_args(self, allt, scalars, convert):
        args = []
        for p in self.ir.params + [o[0] for o in self.ir.outputs]:
            if isinstance(p, TensorParam):
                t = allt[p.name]
                args.append(convert(t))
                args += list(t.shape) + list(t.stride())
            else:
                args.append(scalars[p.name])
        return args

    def _run_triton(self, allt, scalars, grid):
        args = self._flat_args(allt, scalars, lambda t: t)
        self.fn[grid](*args, num_warps=self.ir.num_warps, num_stages=self.ir.num_stages)

    def _run_numba(self, allt, scalars, grid):
        back = []

        def convert(t: torch.Tensor):
            if t.device.type != "cpu":
                raise DSLError("the numba backend runs on CPU tensors; move them with .cpu() or use backend='triton'")
            c = t if t.is_contiguous() else t.contiguous()
            if c is not t:
                back.append((t, c))
            if c.dtype == torch.bfloat16:
                return c.view(torch.int16).numpy().view(np.uint16).reshape(-1)
            if c.dtype == torch.uint32:
                return c.view(torch.int32).numpy().view(np.uint32).reshape(-1)
            return c.numpy().reshape(-1)

        args = []
        for p in self.ir.params + [o[0] for o in self.ir.outputs]:
            if isinstance(p, TensorParam):
                t = allt[p.name]
                arr = convert(t)
                c = back[-1][1] if back and back[-1][0] is t else t
                args.append(arr)
                args += list(c.shape) + list(c.stride())
            else:
                args.append(scalars[p.name])
        g = tuple(grid) + (1,) * (3 - len(grid))
        self.fn(*args, *g)
        for t, c in back:
            t.copy_(c)

    def _run_reference(self, allt, scalars, grid):
        arrays = {name: _to_numpy(t) for name, t in allt.items()}
        Interpreter(self.ir, arrays, scalars).run(grid)
        written = {n.arg[0] for n in self.ir.walk() if n.op in ("store", "atomic_add")}
        for name in written:
            t = allt[name]
            src = arrays[name]
            if t.dtype == torch.uint32:
                src = src.view(np.int32)
                t.copy_(torch.from_numpy(src).view(torch.uint32).to(t.device))
            else:
                t.copy_(torch.from_numpy(np.ascontiguousarray(src)).to(t.dtype).to(t.device))


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A private numpy copy in the interpreter's register types (16-bit floats held as fp32)."""
    a = t.detach().cpu()
    if a.dtype in (torch.float16, torch.bfloat16):
        return a.float().numpy().copy()
    if a.dtype == torch.uint32:
        return a.view(torch.int32).numpy().view(np.uint32).copy()
    return a.numpy().copy()


class _ShapeOnly:
    def __init__(self, shape):
        self.shape = tuple(shape)
        self.ndim = len(shape)
