"""The GPU source of every MoE kernel variant compiles for sm_90 (no GPU needed).

The Triton interpreter accepts programs the compiler rejects (scalar/tile mixes in loop-carried
values, dot shapes), so the align step and each gather kernel (GLU, weighted, combine; both
dequantizations; 2/4/8-bit; the packed-fp16 decode pair and the one-pass decode MoE) are compiled ahead of time in a process
without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys

CASES = """
import re
import torch
from kilnx.codegen.aot import compile_for_target
from kilnx.kernels import moe as M
from kilnx.kernels.moe_align import (align_buffers, align_formula, chunk_counts_formula, moe_align_count,
                                     moe_align_scatter)
from kilnx.kernels.moe_specs import random_expert_weights
T, k, E, H, F = 5, 2, 4, 256, 128
x, h = torch.randn(T, H).bfloat16(), torch.randn(T * k, F).bfloat16()
ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
rw = torch.softmax(torch.randn(T, k), -1).bfloat16()
sorted_ids, block_expert, _ = align_formula(ids, E, 16)
counts = chunk_counts_formula(ids, E, 64)
compile_for_target(moe_align_count.kernel, (ids, counts), {})
compile_for_target(moe_align_scatter.kernel, (ids, counts, *align_buffers(ids, E, 16)), {})
for bits in (2, 4, 8):
    gu, dn = random_expert_weights(E, 2 * F, H, bits, 64), random_expert_weights(E, H, F, bits, 64)
    cases = [(M.gather_qmm_glu, (x, *gu, sorted_ids, block_expert, ids)),
             (M.gather_qmm_combine, (h, *dn, sorted_ids, block_expert, rw)),
             (M.gather_qmv_glu, (x, *gu, ids)), (M.gather_qmv_combine, (h, *dn, ids, rw))]
    if bits == 4:
        cases += [(M.gather_qmm, (x, *gu, sorted_ids, block_expert, rw)), (M.gather_qmv, (h, *dn, ids))]
    for kernel, args in cases:
        for magic in ((True, False) if bits == 4 else (True,)):
            compile_for_target(kernel, args, {"MAGIC": magic})
        if kernel in (M.gather_qmv_glu, M.gather_qmv_combine):   # the pipelined chunk loop
            ck = compile_for_target(kernel, args, {"STAGES": 3, "BLOCK_KW": 16}, aligned=True)
            assert "cp.async" in ck.asm["ptx"], kernel.name
    if bits in (4, 8):   # the packed-fp16 decode GEMVs (kernels/moe_h2.py) on prepared activations
        from kilnx.kernels import moe_h2 as MH
        from kilnx.kernels import qmv_h2 as QH
        px, ph = QH._prep_spec(x, PER=32 // bits, GROUP=64), QH._prep_spec(h, PER=32 // bits, GROUP=64)
        for kernel, args in ((MH.gather_qmv_h2_glu, (*px, *gu, ids)), (MH.gather_qmv_h2_combine, (*ph, *dn, ids, rw)),
                             (MH.gather_qmv_h2_act, (*px, *gu, ids))):     # gate_up's rows stand in for an up stack
            for cfg in ({"STAGES": 1, "BLOCK_N": 8}, {"STAGES": 3, "BLOCK_N": 16, "BLOCK_KW": 16},
                        {"STAGES": 1, "BLOCK_N": 8, "BLOCK_KW": 64, "CHAIN": 4}):    # the combine's masked-K default
                ck = compile_for_target(kernel, args, cfg, aligned=True)
                assert ck.asm["ptx"].count("fma.rn.f16x2") >= 2, kernel.name
                assert ("cp.async" in ck.asm["ptx"]) == (cfg["STAGES"] > 1), kernel.name
        # the one-pass decode MoE: its down partials reach the output as relaxed reductions (no acq_rel)
        from kilnx.kernels import moe_onepass as MO
        for cfg in ({"STAGES": 1, "BLOCK_F": 16}, {"STAGES": 3, "BLOCK_F": 32, "BLOCK_KW": 16, "BLOCK_H": 64},
                    {"STAGES": 3, "BLOCK_F": 32, "BLOCK_KW": 16, "BLOCK_H": 256}):
            ck = compile_for_target(MO.moe_onepass_h2, (*px, *gu, *dn, ids, rw), cfg, aligned=True)
            ptx = ck.asm["ptx"]
            assert ptx.count("fma.rn.f16x2") >= 4 and "atom." not in ptx, cfg
            assert re.search(r"red[.]global[.]gpu[.]relaxed[.]add([.]v[24])?[.]f32", ptx), cfg     # v4: sm_90's vector form
# GGUF experts (kilnx.quant.gguf_formats): fp32 scales in groups of 32, 4-bit gate / up with 8-bit down (a Q4_K_M
# file's Q4_K / requantized Q6_K), on the packed-fp16 decode pair and the one pass
from kilnx.kernels import moe_h2 as MH, moe_onepass as MO, qmv_h2 as QH
gu = random_expert_weights(E, 2 * F, H, 4, 32, dtype=torch.float32)
dn = random_expert_weights(E, H, F, 8, 32, dtype=torch.float32)
px, ph = QH._prep_spec(x, PER=8, GROUP=32), QH._prep_spec(h, PER=4, GROUP=32)
compile_for_target(MH.gather_qmv_h2_glu, (*px, *gu, ids), {}, aligned=True)
compile_for_target(MH.gather_qmv_h2_combine, (*ph, *dn, ids, rw), {}, aligned=True)
compile_for_target(MO.moe_onepass_h2, (*px, *gu, *dn, ids, rw), {"STAGES": 1, "BLOCK_F": 16}, aligned=True)
from kilnx.kernels.moe_route import moe_topk, moe_topk_sigmoid
for logits in (torch.randn(3, 128).bfloat16(), torch.randn(5, 60)):
    compile_for_target(moe_topk, (logits,), {"ROWS": 2}, kw={"TOP_K": 8, "NORM": True})
    compile_for_target(moe_topk_sigmoid, (logits, torch.randn(logits.shape[1])), {"ROWS": 2},
                       kw={"TOP_K": 6, "NORM": True, "SCALE": 2.5})
print("ok")
"""


def test_moe_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", CASES], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]
