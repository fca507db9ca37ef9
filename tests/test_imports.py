"""Each module of the compiler and the entry points imports on its own, first in a fresh process: the
DSL and codegen packages import each other, and an import cycle shows only when a module other than
the usual first one starts it (`kilnx generate` once failed this way while the tests passed)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import kilnx.codegen
import kilnx.dsl

MODULES = sorted({m.name for pkg in (kilnx.dsl, kilnx.codegen) for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + ".")}
                 | {"kilnx.cli", "kilnx.runtime.cli", "kilnx.runtime.engine", "kilnx.ops", "kilnx.kernels.registry"})


def test_every_compiler_module_and_entry_point_imports_first():
    failures = []
    for name in MODULES:
        r = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=120)
        if r.returncode:
            failures.append(f"{name}: {r.stderr.strip().splitlines()[-1]}")
    assert not failures, "\n".join(failures)
