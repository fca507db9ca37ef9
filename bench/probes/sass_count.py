"""Offline probe: compile a library kernel for sm_90 on this (GPU-less) machine and count the SASS
instructions of its main loop, by opcode. Why: the GPU is lent for minutes per session, and a GEMV's
instruction count per chunk is the first thing a decode change moves (qmv_h2 on gate_up: 434 / 405 / 386
instructions per chunk at CHAIN 1 / 2 / 4; fp4_qmv_h2 on nvfp4: 1081 -> 1040 with the shorter e4m3 decode).

  python bench/probes/sass_count.py qmv_h2 '{"M": 1, "N": 28672, "K": 4096, "bits": 4, "gs": 64}' \
      '{"BLOCK_N": 8, "BLOCK_KW": 128, "num_warps": 2, "STAGES": 3, "CHAIN": 2}' [--sass FILE]

The kernel's own tuning inputs (`make_args(problem, "cpu")`) give the argument shapes; pointers and
multiples of 16 are declared aligned, as the JIT finds them on real tensors. The loop is the block
between the first label and the backward branch to it (the pipelined chunk loop of the GEMVs); a
kernel with several loops reports the first.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess

import triton

from kilnx.codegen.aot import compile_for_target
from kilnx.kernels import registry

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def opcodes(lines) -> collections.Counter:
    return collections.Counter(m.group(1) for line in lines if (m := INSTRUCTION.search(line)))


def main_loop(sass: str) -> list[str]:
    """The lines of the first loop: from a label to the branch that jumps back to it."""
    lines = sass.splitlines()
    for i, line in enumerate(lines):
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            back = [j for j in range(i + 1, len(lines)) if f"`({label.group(1)})" in lines[j] and "BRA" in lines[j]]
            if back:
                return lines[i:back[0] + 1]
    return []


def sass_of(compiled) -> str:
    """The SASS of a compiled Triton kernel (nvdisasm of its cubin)."""
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kilnx_sass_{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    return subprocess.run([NVDISASM, "-c", path], capture_output=True, text=True, check=True).stdout


def operand_facts(compiled) -> dict:
    """Where a wgmma kernel's A operand comes from: whether every warp_group_dot takes it as a register
    tensor (TTGIR), the wgmma count (PTX), and the main loop's SASS opcodes (its shared-memory stores say
    whether anything is staged there)."""
    dots = [ln for ln in compiled.asm["ttgir"].splitlines() if "warp_group_dot " in ln]
    return {"a_in_registers": bool(dots) and all("dot_op<{opIdx = 0" in d.split("*")[0] for d in dots),
            "wgmma": compiled.asm["ptx"].count("wgmma.mma_async"),
            "loop_ops": dict(opcodes(main_loop(sass_of(compiled))))}


def count(kernel_name: str, problem: dict, config: dict, kw: dict | None = None) -> tuple[str, dict, dict]:
    """(SASS, whole-kernel opcode counts, main-loop opcode counts)."""
    kernel = registry.get(kernel_name)
    if kernel.make_args is None:
        raise SystemExit(f"{kernel_name} has no tuning inputs (make_args); pass a kernel that the tuner knows")
    compiled = compile_for_target(kernel, kernel.make_args(problem, "cpu"), config, aligned=True, kw=kw)
    sass = sass_of(compiled)
    return sass, dict(opcodes(sass.splitlines())), dict(opcodes(main_loop(sass)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel")
    ap.add_argument("problem", type=json.loads)
    ap.add_argument("config", type=json.loads)
    ap.add_argument("--kw", type=json.loads, default=None, help="constexpr keywords, e.g. '{\"OUT\": \"bf16\"}'")
    ap.add_argument("--sass", help="also write the whole SASS here")
    a = ap.parse_args()
    sass, whole, loop = count(a.kernel, a.problem, a.config, a.kw)
    if a.sass:
        with open(a.sass, "w") as f:
            f.write(sass)
    top = sorted(loop.items(), key=lambda kv: -kv[1])
    print(f"{a.kernel}: {sum(whole.values())} instructions, main loop {sum(loop.values())}")
    print("  " + ", ".join(f"{op} {n}" for op, n in top))
