"""Triton's cache key remembered on disk: the same value triton computes, read back by the next process
without hashing, and recomputed when any file of the installation changes."""

from __future__ import annotations

import os
import subprocess
import sys

from kilnx.codegen.triton_key import fingerprint


def test_fingerprint_follows_every_file(tmp_path):
    (tmp_path / "_C").mkdir()
    lib = tmp_path / "_C" / "libtriton.so"
    lib.write_bytes(b"x" * 100)
    (tmp_path / "compiler.py").write_text("a = 1\n")
    first = fingerprint(tmp_path, "3.6.0")
    assert fingerprint(tmp_path, "3.6.0") == first
    assert fingerprint(tmp_path, "3.7.0") != first                  # the version is part of it
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "compiler.cpython-311.pyc").write_bytes(b"c")
    assert fingerprint(tmp_path, "3.6.0") == first                  # bytecode is not
    lib.write_bytes(b"y" * 101)                                     # a rebuilt library
    second = fingerprint(tmp_path, "3.6.0")
    assert second != first
    os.utime(tmp_path / "compiler.py", ns=(1, 1))                   # same size, new mtime
    assert fingerprint(tmp_path, "3.6.0") != second


def test_remembered_value_is_triton_s_and_the_next_process_does_not_hash(tmp_path):
    env = {**os.environ, "KILNX_CACHE_DIR": str(tmp_path)}
    first = ("import triton.runtime.cache as c\n"
             "real = c.triton_key()\n"
             "from kilnx.codegen import triton_key\n"
             "assert triton_key.install()\n"
             "assert c.triton_key() == real\n"
             "print(real)\n")
    # The second process's triton cannot hash: the value must come from the file.
    second = ("import triton.runtime.cache as c\n"
              "def refuse():\n"
              "    raise AssertionError('hashed again')\n"
              "c.triton_key = refuse\n"
              "from kilnx.codegen import triton_key\n"
              "assert triton_key.install()\n"
              "print(c.triton_key())\n")
    out = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
           for code in (first, second)]
    assert out[0] == out[1] and len(out[0]) > 40
    assert len(list((tmp_path / "triton_key").glob("*.txt"))) == 1
