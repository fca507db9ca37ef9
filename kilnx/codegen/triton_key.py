"""Triton's own cache key, remembered on disk by the stat of the files it is a hash of.

Triton names each compiled kernel in its on-disk cache by a hash that includes `triton_key()`: a sha256 of
its compiler's, backends' and language's sources and of its ~100 MB shared library, computed once per
process (0.4 s on the H200 host, 1.6 s on a 2-core CI machine), on the path to a new process's first
kernel. Every file it reads lies under triton's package directory, so kilnx stores the value under a
fingerprint of that directory: the (path, size, mtime_ns) of every file in it and triton's version
(~15 ms to take). A new process with the same installation reads the value back; a reinstall or any
edited file changes the fingerprint and the key is computed again, by triton.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from kilnx.cache.location import cache_root, write_atomically

_installed = False


def fingerprint(package_dir: Path, version: str) -> str:
    h = hashlib.sha256(version.encode())
    for d, dirs, files in os.walk(package_dir):
        dirs.sort()
        if "__pycache__" in dirs:       # bytecode comes and goes with the interpreter's settings
            dirs.remove("__pycache__")
        for name in sorted(files):
            p = os.path.join(d, name)
            try:
                st = os.stat(p)
            except OSError:
                continue
            h.update(f"{os.path.relpath(p, package_dir)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def install() -> bool:
    """Serve triton_key() from the remembered value in this process (computing and storing it if this
    installation has none yet). False, changing nothing, where triton has no such function."""
    global _installed
    if _installed:
        return True
    try:
        import triton
        import triton.runtime.cache as triton_cache
    except ImportError:
        return False
    original = getattr(triton_cache, "triton_key", None)
    if original is None:
        return False
    path = cache_root() / "triton_key" / f"{fingerprint(Path(triton.__file__).parent, triton.__version__)}.txt"
    try:
        value = path.read_text()
    except OSError:
        value = ""
    if not value:
        value = original()
        try:
            write_atomically(path, value)
        except OSError:
            pass            # an unwritable cache only means the next process hashes again

    def triton_key() -> str:
        return value

    # Modules that imported the function by name hold their own reference: replace each one.
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "triton" or name.startswith("triton.")):
            for attr, v in list(vars(module).items()):
                if v is original:
                    setattr(module, attr, triton_key)
    _installed = True
    return True
