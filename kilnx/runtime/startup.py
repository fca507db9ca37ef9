"""The kernels a model's start-up launches, remembered so that the next process builds them ahead.

Before a new process's first token, the engine's decode step and first prefill build every kernel they
launch: trace the DSL function, generate its Triton source, import it (~10 ms each, ~25 kernels for
llama-3.1-8b on the H200 host, on the main thread; bench/probes/cold_phases.py). Which kernels, configs and
argument shapes those are is the same from one process to the next for the same model, so the engine
writes them to a small manifest after its start-up, and the next process's warm-up thread
(kilnx/codegen/launch.py) builds them while the weights load. A kernel's first launch on the main
thread then finds its build done (it waits for the warm-up thread rather than building beside it).

An entry names a kernel (module and name), its backend, its config, its tensors' dtypes and shapes and its
keyword arguments (runtime scalars by type only); the build happens on meta tensors of those shapes, so
specializations computed from shapes come out as they did. A manifest that no longer matches (other code,
another model under the same key) only costs builds that go unused: every build is keyed as before.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import os
import threading

import torch

MAX_ENTRIES = 256
_lock = threading.Lock()
_entries: list[str] = []          # repr of each entry this process launched, first use order
_seen: set[str] = set()
_saved_upto: dict[str, int] = {}  # manifest key -> entries written


def model_key(*parts) -> str:
    """A manifest's name from what identifies a model's start-up (its spec, weight format, dtype, device)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _manifest(key: str):
    from kilnx.cache.location import cache_root
    return cache_root() / "startup" / f"{key}.txt"


def record(kernel, launch, config: dict, args, kw: dict) -> None:
    """Note a Triton launch this process made for the first time with these shapes (KernelBase.__call__)."""
    if launch.backend != "triton" or len(_entries) >= MAX_ENTRIES:
        return
    module = getattr(getattr(kernel, "fn", None), "__module__", None)
    tensors = []
    for a in args:
        if a is None:
            tensors.append(None)
        elif isinstance(a, torch.Tensor):
            tensors.append((str(a.dtype).removeprefix("torch."), tuple(a.shape)))
        else:
            return
    kws = {}
    for k, v in kw.items():
        if not kernel._is_constexpr(k):
            v = type(v)(0) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
        kws[k] = v
    entry = (module, kernel.name, launch.backend, dict(config), tuple(tensors), kws)
    text = repr(entry)
    try:
        if ast.literal_eval(text) != entry:
            return
    except (ValueError, SyntaxError):
        return                    # a value with no literal form (a dtype object, a function): not replayable
    with _lock:
        if text not in _seen:
            _seen.add(text)
            _entries.append(text)


def save(key: str) -> None:
    """Write what this process launched so far as `key`'s manifest (once more only if it grew)."""
    with _lock:
        if _saved_upto.get(key) == len(_entries) or not _entries:
            return
        lines = list(_entries)
        _saved_upto[key] = len(lines)
    path = _manifest(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass                      # no manifest: the next start builds on its main thread, as before


def prebuild(key: str) -> int:
    """Build the kernels of `key`'s manifest (on the warm-up thread); how many were built or found built."""
    try:
        lines = _manifest(key).read_text().splitlines()
    except OSError:
        return 0
    built = 0
    for line in lines[:MAX_ENTRIES]:
        try:
            module, name, backend, config, tensors, kw = ast.literal_eval(line)
            kernel = _kernel(module, name)
            if kernel is None:
                continue
            args = tuple(None if t is None else torch.empty(t[1], dtype=getattr(torch, t[0]), device="meta")
                         for t in tensors)
            launch = kernel._launch(config, args, kw, backend)
            getattr(launch.fn, "cache_key", None)   # Triton's hash of the function and its callees
            built += 1
        except Exception:  # noqa: BLE001 - a stale entry is skipped; the real launch builds what it needs
            continue
    return built


def _kernel(module: str | None, name: str):
    """The kernel object `name` defined in kilnx module `module`."""
    if not module or not module.startswith("kilnx."):
        return None
    for obj in vars(importlib.import_module(module)).values():
        if getattr(obj, "name", None) == name and hasattr(obj, "_launch") and hasattr(obj, "_compiled"):
            return obj
    return None


# kilnx.dsl.kernel's name is shadowed by its decorator in kilnx.dsl: import the module itself
importlib.import_module("kilnx.dsl.kernel").FIRST_USE_HOOKS.append(record)
