"""The tensor-core design probes (bench/probes/tc_gemv.py, tc_qmm.py): their host packing and kernels give
MLX's product under the interpreter, and, compiled for sm_90 by the installed Triton, its weight reaches the
wgmma as a register operand with no shared-memory round trip on the way. Their packing is the library's
(kernels/qmv_wg.py, tested in test_qmv_wg.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from test_qmv_wg import _case as _mlx_case, _close     # MLX-quantized weights, x, and x @ dequantize().T

PROBE = Path(__file__).resolve().parents[2] / "bench" / "probes" / "tc_gemv.py"


def _probe(name: str = "tc_gemv"):
    if str(PROBE.parent) not in sys.path:      # tc_qmm imports tc_gemv's packing
        sys.path.insert(0, str(PROBE.parent))
    spec = importlib.util.spec_from_file_location(f"{name}_probe", PROBE.parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernel under the Triton interpreter")
@settings(max_examples=6, deadline=None)
@given(st.sampled_from([(64, 64), (128, 192)]), st.sampled_from([1, 3, 16]), st.sampled_from([1, 2]),
       st.sampled_from([1, 2]), st.integers(0, 10_000))
def test_matches_mlx_quantized_matmul(shape, m, split, wg, seed):
    p = _probe()
    n, k = shape
    wg = min(wg, n // 64)
    wq, s, b, x, y = _mlx_case(n, k, m, seed)
    got = p.tc_gemv(x, p.pack(wq, wg), p.group_major(s, wg), p.group_major(b, wg), split_k=split, asm=False).float()
    assert _close(got, y)


CHECK = """
import json, sys
sys.path.insert(0, sys.argv[1])
import tc_gemv, tc_qmm
facts = {f"tc_gemv asm={asm} wg={wg}": tc_gemv.compile_report(asm=asm, wg=wg) for asm in (True, False) for wg in (1, 2)}
facts.update({f"tc_qmm wg={wg} BM={bm}": tc_qmm.compile_report(wg=wg, block_m=bm) for wg, bm in ((1, 128), (2, 256))})
print(json.dumps(facts))
"""


def test_weight_reaches_the_wgmma_in_registers_for_sm90():
    """No shared-memory store of the weight in either probe's loop: tc_gemv stores only x's (64 x 16) B tile
    (one 16-byte store a thread; the decoded weight tile would take four or more), tc_qmm's pipeliner copies
    x and the bytes with cp.async (no stores at all); every wgmma takes the weight from registers."""
    # compiled in a process without TRITON_INTERPRET (the interpreter replaces the jit function)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CHECK, str(PROBE.parent)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    for case, r in json.loads(run.stdout.strip().splitlines()[-1]).items():
        assert r["wgmma"] > 0 and r["a_in_registers"], f"{case}: the weight is not wgmma's register operand"
        stores = r["loop_ops"].get("STS", 0) + r["loop_ops"].get("STSM", 0)
        assert r["loop_ops"].get("HGMMA", 0) == 4, (case, r["loop_ops"])
        assert stores <= (1 if case.startswith("tc_gemv") else 0), (case, r["loop_ops"])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernel under the Triton interpreter")
@settings(max_examples=6, deadline=None)
@given(st.sampled_from([1, 2]), st.sampled_from([1, 5, 17, 64, 100]), st.sampled_from([(1, 1), (2, 1), (4, 2), (2, 2)]),
       st.integers(0, 10_000))
def test_the_gemm_matches_mlx_quantized_matmul(wg, m, gpi_split, seed):
    """Any rows (16 a program at the GEMV's sizes), GPI groups a K step, K split over programs or not."""
    qmm = _probe("tc_qmm")
    gpi, split = gpi_split
    wq, s, b, x, y = _mlx_case(128, 512, m, seed)
    got = qmm.tc_qmm(x, qmm.pack(wq, wg), qmm.group_major(s, wg), qmm.group_major(b, wg), block_m=16 if m < 16 else 64,
                     asm=False, num_stages=1, gpi=gpi, split_k=split).float()
    assert _close(got, y)


@pytest.mark.gpu
@pytest.mark.parametrize("asm", [False, True])
@pytest.mark.parametrize("split", [1, 4])
def test_matches_mlx_on_the_gpu_with_either_decode(asm, split):
    p = _probe()
    wq, s, b, x, y = _mlx_case(256, 512, 5, 7)
    for wg in (1, 2):
        args = [t.cuda() for t in (p.pack(wq, wg), p.group_major(s, wg), p.group_major(b, wg))]
        for stages in (1, 3):
            got = p.tc_gemv(x.cuda(), *args, split_k=split, asm=asm, num_stages=stages).float().cpu()
            assert _close(got, y)


@pytest.mark.gpu
@pytest.mark.parametrize("asm", [False, True])
def test_the_gemm_matches_mlx_on_the_gpu(asm):
    qmm = _probe("tc_qmm")
    wq, s, b, x, y = _mlx_case(256, 512, 300, 11)
    for wg, bm, stages, gpi, split in ((1, 128, 3, 1, 1), (2, 128, 3, 2, 1), (2, 256, 3, 1, 1), (2, 64, 1, 4, 2),
                                       (1, 16, 3, 8, 1), (1, 16, 1, 4, 4)):
        args = [t.cuda() for t in (qmm.pack(wq, wg), qmm.group_major(s, wg), qmm.group_major(b, wg))]
        got = qmm.tc_qmm(x.cuda(), *args, block_m=bm, asm=asm, num_stages=stages, gpi=gpi, split_k=split).float().cpu()
        assert _close(got, y), (wg, bm, stages, gpi, split)
