"""The mma.sync design probe (bench/probes/mma_gemv.py): its kWidth-4 packing round-trips, its kernel gives MLX's
product under the interpreter for one and two warps a program, split over K or not, and the probe's own timing
script runs end to end there (a small shape)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from test_qmv_wg import _case, _close     # MLX-quantized weights, x, and x @ dequantize().T

from kilnx.kernels import qmv_wg as W

PROBE = Path(__file__).resolve().parents[2] / "bench" / "probes" / "mma_gemv.py"
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the kernel under the Triton interpreter")


def _probe():
    spec = importlib.util.spec_from_file_location("mma_gemv_probe", PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_packing_keeps_every_code():
    p = _probe()
    words, s, b, _, _ = _case(128, 256, 1, 0)
    want = W.dequantized(W.pack_operand(words), W.group_major(s), W.group_major(b))
    assert torch.equal(p.dequant_kw4(p.pack_kw4(words), W.group_major(s), W.group_major(b)), want)


@interpreted
@settings(max_examples=5, deadline=None)
@given(st.sampled_from([(64, 128), (128, 256)]), st.sampled_from([1, 3, 16, 20]), st.sampled_from([1, 2]),
       st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.integers(0, 10_000))
def test_the_kernel_gives_mlx_product(shape, m, nw, gpi, split, seed):
    p = _probe()
    words, s, b, x, want = _case(*shape, m, seed)
    got = p.qmv_mma(x, p.pack_kw4(words), W.group_major(s), W.group_major(b), NW=nw, backend="triton",
                    config={"BLOCK_M": 16, "GPI": gpi, "SPLIT_K": split, "num_warps": nw})
    assert got.shape == (m, shape[0]) and _close(got, want)


@interpreted
def test_the_probe_runs(tmp_path):
    p = _probe()
    out = tmp_path / "mma.csv"
    p.main(str(out), 1)
    lines = out.read_text().splitlines()
    assert lines[0].startswith("case,path,round,us") and any(",mma_nw" in ln for ln in lines[1:])


SM90 = """
import json, sys, torch
sys.path.insert(0, "bench/probes")
from sass_count import main_loop, opcodes, sass_of
from kilnx.codegen.aot import compile_for_target
from kilnx.kernels import qmv_wg as W
import mma_gemv as P
wb, sg = torch.zeros(4, 64 * 2048, dtype=torch.uint8), torch.zeros(4, 64, 64).bfloat16()
c = compile_for_target(P.qmv_mma, (torch.zeros(4, 4096).bfloat16(), wb, sg, sg),
                       {"GPI": 4, "num_stages": 2, "num_warps": 1}, aligned=True, kw={"NW": 1})
dots = [ln for ln in c.asm["ttgir"].splitlines() if "tt.dot " in ln]
converts = [ln for ln in c.asm["ttgir"].splitlines() if "convert_layout" in ln and "dot_op<{opIdx = 0" in ln]
print(json.dumps({"dots": dots, "a_converts": converts, "loop_ops": dict(opcodes(main_loop(sass_of(c))))}))
"""


def test_compiled_for_sm90_the_weight_reaches_mma_sync_in_registers():
    """What the probe's doc says of the sm_90 code: mma.sync (HMMA) with the decoded weight as a kWidth-4 register
    operand, no layout conversion into it and no shared-memory store in the main loop."""
    import json
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = PROBE.parents[2]
    run = subprocess.run([sys.executable, "-c", SM90], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    assert facts["dots"] and all("dot_op<{opIdx = 0, parent = #mma, kWidth = 4}>" in d for d in facts["dots"])
    assert facts["a_converts"] == []
    ops = facts["loop_ops"]
    assert ops.get("HMMA", 0) >= 8 and ops.get("STS", 0) + ops.get("STSM", 0) == 0, ops
