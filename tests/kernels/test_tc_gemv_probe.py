"""The tensor-core design probes (bench/probes/tc_gemv.py, tc_qmm.py): their host packing and kernels give
MLX's product under the interpreter, and, compiled for sm_90 by the installed Triton, its weight reaches the
wgmma as a register operand with no shared-memory round trip or layout conversion on the way."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kilnx.quant import QWeight

PROBE = Path(__file__).resolve().parents[2] / "bench" / "probes" / "tc_gemv.py"


def _probe(name: str = "tc_gemv"):
    if str(PROBE.parent) not in sys.path:      # tc_qmm imports tc_gemv's packing
        sys.path.insert(0, str(PROBE.parent))
    spec = importlib.util.spec_from_file_location(f"{name}_probe", PROBE.parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mlx_case(n, k, m, seed):
    """Weights quantized by MLX (mx.quantize), and the product's meaning: x @ w.dequantize().T in fp32 (kilnx's
    qmatmul; MLX's own bf16 quantized_matmul differs from it by ~2% of the largest output on these cases)."""
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(mx.bfloat16)

    def t(a):
        return torch.from_numpy(np.array(a.astype(mx.float32)))
    words = torch.from_numpy(np.array(wq).view(np.int32)).view(torch.uint32)
    s, b, x = t(s).bfloat16(), t(b).bfloat16(), t(x).bfloat16()
    dense = QWeight.from_mlx(words, s, b, bits=4, group_size=64).dequantize().float()
    return words, s, b, x, x.float() @ dense.t()


def _close(got, y):
    """Within the output's bf16 rounding (an ulp: the interpreter's conversion truncates) of the fp32 product."""
    return torch.allclose(got, y, rtol=1e-2, atol=1e-2 * y.abs().max().item())


def test_packing_places_every_code_where_the_module_doc_says():
    p = _probe()
    n, k = 128, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.int64)
    words = torch.zeros(n, k // 8, dtype=torch.int64)
    for j in range(8):
        words |= codes[:, j::8] << (4 * j)
    wq = words.to(torch.int32).view(torch.uint32)
    packed = p.pack(wq)
    assert packed.shape == (n // 64, k // 64, 2048)
    for pb, g, e in [(0, 0, 0), (1, 1, 2047), (0, 1, 777), (1, 0, 1234), (1, 1, 513)]:
        o, lane, warp = e % 16, e // 16 % 32, e // 512
        row = pb * 64 + 16 * warp + 8 * (o % 2) + lane // 4
        col = lane % 4 + 4 * (o // 2)
        byte = int(packed[pb, g, e])
        assert byte & 0xF == codes[row, g * 64 + 2 * col] and byte >> 4 == codes[row, g * 64 + 2 * col + 1]
    two = p.pack(wq, wg=2)          # one program of two warpgroups: warps 4..7 hold rows 64..127
    assert two.shape == (1, k // 64, 4096) and int(two[0, 1, 2048 + 5 * 16]) == int(packed[1, 1, 5 * 16])


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
@settings(max_examples=4, deadline=None)
@given(st.sampled_from([1, 2]), st.sampled_from([17, 64, 100]), st.integers(0, 10_000))
def test_the_gemm_matches_mlx_quantized_matmul(wg, m, seed):
    qmm = _probe("tc_qmm")
    wq, s, b, x, y = _mlx_case(128, 128, m, seed)
    got = qmm.tc_qmm(x, qmm.pack(wq, wg), qmm.group_major(s, wg), qmm.group_major(b, wg), block_m=64,
                     asm=False, num_stages=1).float()
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
    for wg, bm, stages in ((1, 128, 3), (2, 128, 3), (2, 256, 3), (2, 64, 1)):
        args = [t.cuda() for t in (qmm.pack(wq, wg), qmm.group_major(s, wg), qmm.group_major(b, wg))]
        got = qmm.tc_qmm(x.cuda(), *args, block_m=bm, asm=asm, num_stages=stages).float().cpu()
        assert _close(got, y), (wg, bm, stages)
