"""The tensor-core GEMV design probe (bench/probes/tc_gemv.py): its host packing and kernel give MLX's
product under the interpreter, and, compiled for sm_90 by the installed Triton, its weight reaches the
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

PROBE = Path(__file__).resolve().parents[2] / "bench" / "probes" / "tc_gemv.py"


def _probe():
    spec = importlib.util.spec_from_file_location("tc_gemv_probe", PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mlx_case(n, k, m, seed):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(mx.bfloat16)
    y = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4).astype(mx.float32)

    def t(a):
        return torch.from_numpy(np.array(a.astype(mx.float32)))
    words = torch.from_numpy(np.array(wq).view(np.int32)).view(torch.uint32)
    return words, t(s).bfloat16(), t(b).bfloat16(), t(x).bfloat16(), t(y)


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
    # MLX rounds to bf16 once; the probe sums in fp32 and rounds once (split: stays fp32)
    assert torch.allclose(got, y, rtol=2e-2, atol=2e-2 * y.abs().max().item())


CHECK = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("p", sys.argv[1]); p = importlib.util.module_from_spec(spec)
spec.loader.exec_module(p)
print(json.dumps({f"asm={asm} wg={wg}": {k: v for k, v in p.compile_report(asm=asm, wg=wg).items() if k != "ttgir"}
                  for asm in (True, False) for wg in (1, 2)}))
"""


def test_weight_reaches_the_wgmma_in_registers_for_sm90():
    # compiled in a process without TRITON_INTERPRET (the interpreter replaces the jit function)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CHECK, str(PROBE)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for case, r in json.loads(run.stdout.strip().splitlines()[-1]).items():
        assert r["wgmma"] > 0 and r["a_in_registers"], f"{case}: the weight is not wgmma's register operand"
        # one shared-memory tile per group: x's (64 x 16) B operand; none for the weight
        assert len(r["local_allocs"]) == 1 and "64x16xbf16" in r["local_allocs"][0], r["local_allocs"]
        weight_converts = [c for c in r["converts"] if "xi8" in c or "x64xbf16" in c or "x32xi" in c or "x2xbf16" in c]
        assert not weight_converts, weight_converts


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
            assert torch.allclose(got, y, rtol=2e-2, atol=2e-2 * y.abs().max().item())
