"""The GPU source of every quantized-GEMM variant compiles for sm_90 (no GPU needed).

The Triton interpreter accepts programs the compiler rejects, so each tunable branch of the library's
GEMM kernels (magic-number vs int->float dequantization, swapped dot operands, split-K, several rows)
is compiled ahead of time for an sm_90 target, in a process without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys

CASES = """
import torch
from kilnx.codegen.aot import compile_for_target
from kilnx.kernels import qmatmul as Q
from kilnx.kernels import qmv_h2 as H
from kilnx.quant import QWeight
x = torch.randn(4, 256).bfloat16()
for bits in (3, 4, 8):
    w = QWeight.quantize(torch.randn(64, 256), bits=bits, group_size=64)
    w = QWeight.from_mlx(w.packed, w.scales.bfloat16(), w.biases.bfloat16(), bits=bits, group_size=64)
    args = (x, w.packed, w.scales, w.biases)
    for cfg in ({"SWAP": True, "MAGIC": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128},
                {"SWAP": False, "MAGIC": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}):
        compile_for_target(Q.qmm, args, cfg)
    if bits == 4:   # the GPU defaults above 16 rows: codes decoded in bf16 pairs, the weight wgmma's A operand
        for tile in ((64, 64, 128, 4), (128, 128, 64, 8)):
            cfg = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps"), tile), SWAP=True, PACKED=True)
            ptx = compile_for_target(Q.qmm, args, cfg).asm["ptx"]
            assert "fma.rn.bf16x2" in ptx and "wgmma" in ptx, "packed qmm off the bf16x2 decode or the wgmma"
    if 32 % bits == 0:
        compile_for_target(Q.dequant, args[1:], {}, kw={"BITS": bits, "GROUP": 64})
        from kilnx.kernels.embedding import embedding_q_kernel
        for out in ("bf16", "f32"):   # the quantized embedding lookup (not yet run on a GPU)
            compile_for_target(embedding_q_kernel, (*args[1:], torch.tensor([3, 0, 63])), {},
                               kw={"scale": 25.3, "BITS": bits, "GROUP": 64, "OUT": out})
        compile_for_target(Q.mm, (x, torch.randn(64, 256).bfloat16()), {"BLOCK_M": 64, "BLOCK_N": 64})
        planes, sums = Q.qmv_prep(x.float(), PER=32 // bits, GROUP=64, backend="reference")
        compile_for_target(Q.qmv_prep, (x,), {}, kw={"PER": 32 // bits, "GROUP": 64})
        for rows in (1, 4):
            pargs = (planes[:rows], sums[:rows], *args[1:])
            for cfg in ({"MAGIC": True}, {"MAGIC": False, "SPLIT_K": 2, "BLOCK_KW": 64},
                        {"STAGES": 3, "BLOCK_KW": 32}):
                ck = compile_for_target(Q.qmv, pargs, cfg)
                if cfg.get("STAGES", 1) > 1:   # the chunk loads are pipelined through shared memory
                    assert "cp.async" in ck.asm["ptx"], "qmv with STAGES=3 was not pipelined"
    if bits in H.BITS_SERVED:
        compile_for_target(H.qmv_h2_prep, (x,), {}, kw={"PER": 32 // bits, "GROUP": 64})
        prepared = H._prep_spec(x, PER=32 // bits, GROUP=64)
        for rows in (1, 4):
            pargs = (*(t[:rows] for t in prepared), *args[1:])
            for cfg in ({}, {"SPLIT_K": 2, "BLOCK_KW": 64, "BLOCK_N": 4}, {"STAGES": 2, "BLOCK_KW": 32}):
                ck = compile_for_target(H.qmv_h2, pargs, cfg)
                assert ck.asm["ptx"].count("fma.rn.f16x2") >= 2, "qmv_h2 without packed fp16 math"
                assert ("cp.async" in ck.asm["ptx"]) == (cfg.get("STAGES", 1) > 1), "STAGES is not what pipelines"
from kilnx.kernels.dense_mm import _mm_default
for dt in (torch.bfloat16, torch.float32):   # the dense GEMM's GPU defaults fit an H100's / H200's shared memory
    for rows in (512, 4096):
        xm, wm = torch.randn(rows, 256).to(dt), torch.randn(128, 256).to(dt)
        ck = compile_for_target(Q.mm, (xm, wm), _mm_default(xm, wm), aligned=True)
        assert ck.metadata.shared <= 232448, f"mm's default at {rows} rows of {dt} asks {ck.metadata.shared} B"
from kilnx.kernels.dense_mm import dense_gemv
for dt in (torch.float32, torch.bfloat16):   # the dense GEMV's defaults: nemotron-3's router, a wide weight at 16 rows
    for rows, n, k in ((1, 128, 2688), (16, 4096, 4096)):
        xm, wm = torch.randn(rows, k).to(dt), torch.randn(n, k).to(dt)
        compile_for_target(dense_gemv, (xm, wm), dense_gemv.default_config(xm, wm), aligned=True)
from kilnx.kernels import qmv_tc as T
for bits in (4, 8):
    w = QWeight.quantize(torch.randn(256, 512), bits=bits, group_size=64)
    for dt in (torch.bfloat16, torch.float16):
        targs = (torch.randn(4, 512).to(dt), w.packed, w.scales.to(dt), w.biases.to(dt))
        for cfg in ({"SWAP": True, "STAGES": 3}, {"SWAP": False, "SPLIT_K": 2, "BLOCK_N": 32}):
            ptx = compile_for_target(T.qmv_tc, targs, cfg).asm["ptx"]
            assert ("wgmma" in ptx) if cfg["SWAP"] else ("mma.sync" in ptx), "qmv_tc off the tensor cores"
from kilnx.kernels import prepared as P
xw = torch.randn(2, 4096).bfloat16()
compile_for_target(P.add_rms_norm_prep, (xw, xw, torch.ones(4096).bfloat16()), {},
                   kw={"eps": 1e-5, "offset": 0.0, "PER": 8, "GROUP": 64})
compile_for_target(P.silu_mul_prep, (torch.randn(2, 2 * 448).bfloat16(),), {}, kw={"PER": 4, "GROUP": 64})
from kilnx.kernels import swiglu_prep as SP
wgu = QWeight.quantize(torch.randn(2 * 256, 256), bits=4, group_size=64)
wgu = QWeight.from_mlx(wgu.packed, wgu.scales.bfloat16(), wgu.biases.bfloat16(), bits=4, group_size=64)
xp = H._prep_spec(torch.randn(4, 256), PER=8, GROUP=64)
for rows, cfg in ((1, {"BLOCK_N": 128, "STAGES": 3, "CHAIN": 2}), (4, {"BLOCK_N": 128, "STAGES": 1})):
    ptx = compile_for_target(SP.qmv_h2_swiglu_prep, (*(t[:rows] for t in xp), wgu.packed, wgu.scales, wgu.biases),
                             cfg, kw={"PER_OUT": 8, "GROUP_OUT": 64}).asm["ptx"]
    assert "fma.rn.f16x2" in ptx and "bar.sync" in ptx, "qmv_h2_swiglu_prep off packed fp16 or its read-back barrier"
from kilnx.kernels import attention as A, attention_split as AS
q, kc = torch.randn(1, 1, 32, 128).bfloat16(), torch.randn(1, 8, 1024, 128).bfloat16()
kw = A._kernel_kwargs(q, kc, 128 ** -0.5, None, None)
parts = AS._split_spec(q, kc, kc, torch.tensor([[700]]), KEYS_PER_SPLIT=128, **kw)
compile_for_target(AS.attention_split_kernel, (q, kc, kc, torch.tensor([[700]])),
                   {"BLOCK_M": 16, "BLOCK_N": 64, "KEYS_PER_SPLIT": 128}, kw=kw)
compile_for_target(AS.attention_merge, (*parts, q), {})
from kilnx.kernels import attention_decode as AD
for inter in (False, True):
    kn = torch.randn(1, 8, 128).bfloat16()
    new_kv = (q, kn, kn, torch.tensor([[700]]), torch.zeros(1, dtype=torch.long), torch.ones(64), kc, kc)
    compile_for_target(AD.attention_split_new_kv_kernel, new_kv, {"BLOCK_M": 16, "BLOCK_N": 64, "KEYS_PER_SPLIT": 128},
                       kw={**kw, "INTERLEAVED": inter})
    compile_for_target(AD.attention_new_kv_kernel, new_kv, {"BLOCK_M": 16, "BLOCK_N": 128}, kw={**kw, "INTERLEAVED": inter})
long_kc = torch.randn(1, 8, 8192, 128).bfloat16()   # 64 ranges: the merge reads them in chunks
long_parts = AS._split_spec(q, long_kc, long_kc, torch.tensor([[8000]]), KEYS_PER_SPLIT=128, **kw)
for merge_parts in (parts, long_parts):
    for merge_cfg in ({}, {"num_warps": 4}):
        compile_for_target(AS.attention_merge_prep, (*merge_parts, q), merge_cfg, kw={"PER": 8, "GROUP": 64})
from kilnx.kernels import qkv_rope as QR
for inter in (False, True):
    qa = QR._problem_args({"M": 1, "Hq": 32, "Hk": 8, "D": 128, "K": 256, "S": 64}, "cpu")
    for cfg in ({}, {"BLOCK_N": 64, "STAGES": 1}):
        compile_for_target(QR.qkv_rope_cache_h2, qa, cfg, kw={"INTERLEAVED": inter})
from kilnx.kernels import rope
q, k, v = torch.randn(3, 8, 128).bfloat16(), torch.randn(3, 2, 128).bfloat16(), torch.randn(3, 2, 128).bfloat16()
pos, rows, inv = torch.arange(3), torch.zeros(3, dtype=torch.long), torch.ones(64)
kc = torch.zeros(1, 2, 16, 128).bfloat16()
compile_for_target(rope.rope_cache_kernel.kernel, (q, k, v, pos, rows, inv, kc, kc.clone()), {})
print("ok")
"""


def test_quantized_gemm_variants_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", CASES], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]


FP8_CACHE_CASES = """
import torch
from kilnx.codegen.aot import compile_for_target
from kilnx.kernels import attention as A, attention_decode as AD, attention_split as AS, qk_norm_rope as QN
from kilnx.kernels import qkv_rope as QR, rope
F8 = torch.float8_e4m3fn
WIDEN = ("cvt.rn.f16x2.e4m3x2", "cvt.rn.bf16x2.e4m3x2")   # sm_90 widens pairs (Triton 3.9 here: to f16x2)
def reads(ptx):
    assert any(w in ptx for w in WIDEN), "no e4m3 -> wider conversion"
def writes(ptx):
    assert "cvt.rn.satfinite.e4m3x2" in ptx, "the cache write does not round to e4m3 in hardware"
q, kc = torch.randn(1, 1, 32, 128).bfloat16(), torch.zeros(1, 8, 1024, 128, dtype=F8)
pos = torch.tensor([[700]])
kw = A._kernel_kwargs(q, kc, 128 ** -0.5, None, None)
reads(compile_for_target(AS.attention_split_kernel, (q, kc, kc, pos), {"BLOCK_M": 16, "BLOCK_N": 64,
                                                                       "KEYS_PER_SPLIT": 128}, kw=kw).asm["ptx"])
q17 = torch.randn(1, 17, 32, 128).bfloat16()
reads(compile_for_target(A.attention_kernel, (q17, kc, kc, torch.arange(17)[None]), {"BLOCK_M": 64, "BLOCK_N": 64},
                         kw=kw).asm["ptx"])
kn = torch.randn(1, 8, 128).bfloat16()
new_kv = (q, kn, kn, pos, torch.zeros(1, dtype=torch.long), torch.ones(64), kc, kc)
for kernel, cfg in ((AD.attention_split_new_kv_kernel, {"BLOCK_M": 16, "BLOCK_N": 64, "KEYS_PER_SPLIT": 128}),
                    (AD.attention_new_kv_kernel, {"BLOCK_M": 16, "BLOCK_N": 128})):
    ptx = compile_for_target(kernel, new_kv, cfg, kw=kw).asm["ptx"]
    reads(ptx)
    writes(ptx)
qa = list(QR._problem_args({"M": 1, "Hq": 32, "Hk": 8, "D": 128, "K": 256, "S": 64}, "cpu"))
qa[-2:] = [t.to(F8) for t in qa[-2:]]
writes(compile_for_target(QR.qkv_rope_cache_h2, tuple(qa), {}).asm["ptx"])
t, k, v = torch.randn(3, 8, 128).bfloat16(), torch.randn(3, 2, 128).bfloat16(), torch.randn(3, 2, 128).bfloat16()
p, rows, inv = torch.arange(3), torch.zeros(3, dtype=torch.long), torch.ones(64)
c8 = torch.zeros(1, 2, 16, 128, dtype=F8)
writes(compile_for_target(rope.rope_cache_kernel.kernel, (t, k, v, p, rows, inv, c8, c8.clone()), {}).asm["ptx"])
norm = torch.ones(128).bfloat16()
writes(compile_for_target(QN.qk_norm_rope_cache_kernel.kernel, (t, k, v, norm, norm, p, rows, inv, c8, c8.clone()),
                          {}).asm["ptx"])
print("ok")
"""


def test_the_fp8_kv_cache_kernels_compile_for_sm90():
    """Attention reading an fp8 cache widens it with the e4m3 conversions; every cache writer rounds into it with
    sm_90's saturating cvt (what reference.round_to specifies)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", FP8_CACHE_CASES], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]
