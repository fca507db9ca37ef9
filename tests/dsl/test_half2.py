"""Packed half2 ops (kd.h2_pack, kd.h2_fma, kd.h2_sum): two fp16 values per u32, low half first.

Specification: h2_pack rounds each float to fp16 (nearest even); h2_fma computes a*b + c per half with
ONE rounding to fp16 (the GPU's fma.rn.f16x2); h2_sum widens both halves to fp32 and adds them. Every
backend must give the same bits as numpy's float16 conversions computed here, including the
magic-number decode of 4-bit codes that the quantized GEMV is built on.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kilnx.dsl as kd

on_cpu = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                            reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")
BACKENDS = ["reference", "triton", "numba"]


@kd.kernel(tune={"BLOCK": kd.choice(64)})
def half2_ops(lo, hi, b, c, *, BLOCK):
    n = lo.shape[0]
    r = kd.grid(kd.cdiv(n, BLOCK)) * BLOCK + kd.arange(0, BLOCK)
    a = kd.h2_pack(kd.load(lo, r), kd.load(hi, r))
    f = kd.h2_fma(a, kd.load(b, r), kd.load(c, r))
    packed = kd.output((n,), kd.u32, name="packed")
    fma = kd.output((n,), kd.u32, name="fma")
    total = kd.output((n,), kd.f32, name="total")
    kd.store(packed, r, a)
    kd.store(fma, r, f)
    kd.store(total, r, kd.h2_sum(f))
    return packed, fma, total


def _np_pack(lo, hi):
    lo16 = lo.astype(np.float16).view(np.uint16).astype(np.uint32)
    return lo16 | (hi.astype(np.float16).view(np.uint16).astype(np.uint32) << 16)


def _np_halves(u):
    return ((u & 0xFFFF).astype(np.uint16).view(np.float16), (u >> 16).astype(np.uint16).view(np.float16))


def _expected(lo, hi, b, c):
    a = _np_pack(lo, hi)
    (al, ah), (bl, bh), (cl, ch) = _np_halves(a), _np_halves(b), _np_halves(c)
    rl = (al.astype(np.float64) * bl + cl).astype(np.float16)
    rh = (ah.astype(np.float64) * bh + ch).astype(np.float16)
    fma = _np_pack(rl.astype(np.float32), rh.astype(np.float32))
    return a, fma, rl.astype(np.float32) + rh.astype(np.float32)


def _u32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.uint32).view(np.int32)).view(torch.uint32)


def _halves_bits(rng, n):
    """fp16 bit patterns: random normals, subnormals, zeros of both signs, large values."""
    bits = rng.integers(0, 2**16, size=(2, n), dtype=np.uint32)
    bits[:, :4] = [[0x0000, 0x8000, 0x0001, 0x7BFF], [0x3C00, 0x0400, 0x83FF, 0xFBFF]]
    inf_or_nan = (bits & 0x7C00) == 0x7C00
    bits[inf_or_nan] &= 0xBFFF                     # a finite exponent instead
    return bits[0] | (bits[1] << 16)


def _check_half2_ops(seed, scale, backends, device="cpu"):
    rng = np.random.default_rng(seed)
    n = 100
    lo = (rng.standard_normal(n) * scale).astype(np.float32)
    hi = (rng.standard_normal(n) * scale).astype(np.float32)
    lo[:3] = [2049.0, 2051.0, 1 + 2**-11]          # ties: round to even
    np.seterr(over="ignore", invalid="ignore")
    b, c = _halves_bits(rng, n), _halves_bits(rng, n)
    want = _expected(lo, hi, b, c)
    args = [t.to(device) for t in (torch.from_numpy(lo), torch.from_numpy(hi), _u32(b), _u32(c))]
    for backend in backends:
        got = half2_ops(*args, backend=backend, config={})
        for g, w, what in zip(got, want, ("pack", "fma", "sum")):
            g = g.cpu()
            g = g.view(torch.int32).numpy().view(np.uint32) if g.dtype == torch.uint32 else g.numpy()
            w = w.astype(g.dtype)
            same = (g == w) | (np.isnan(g) & np.isnan(w)) if g.dtype.kind == "f" else g == w
            assert same.all(), f"{backend} {what}: {g[~same][:4]} != {w[~same][:4]}"


@on_cpu
@settings(max_examples=5, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_half2_ops_match_float16_rounding(seed, scale):
    _check_half2_ops(seed, scale, BACKENDS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("seed,scale", [(0, 1e-3), (1, 1.0), (2, 30.0), (3, 300.0)])
def test_half2_ptx_gives_the_reference_bits_on_gpu(seed, scale):
    _check_half2_ops(seed, scale, ["triton"], device="cuda")


@kd.kernel(tune={"BLOCK": kd.choice(32)})
def decode_nibbles(words, *, BLOCK):
    """The 8 nibbles of each word as exact fp16 values: pairs (q_j, q_j+4) for j = 0..3."""
    n = words.shape[0]
    r = kd.grid(kd.cdiv(n, BLOCK)) * BLOCK + kd.arange(0, BLOCK)
    w = kd.load(words, r)
    w8 = w >> 8
    out = kd.output((n, 4), kd.u32)
    for j, (src, mask) in enumerate([(w, 0x000F000F), (w, 0x00F000F0), (w8, 0x000F000F), (w8, 0x00F000F0)]):
        magic = (src & mask) | 0x64006400                       # fp16 1024 + q (or 1024 + 16q) per half
        scale, shift = (0x3C003C00, 0xE400E400) if mask == 0x000F000F else (0x2C002C00, 0xD400D400)
        kd.store(out, r, j, kd.h2_fma(magic, scale, shift))     # q, exactly: one HFMA2 per two codes
    return out


@on_cpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_magic_number_decode_of_4_bit_codes_is_exact(backend):
    words = torch.randint(-2**31, 2**31 - 1, (64,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    got = decode_nibbles(words.view(torch.uint32), backend=backend, config={}).view(torch.int32).numpy().view(np.uint32)
    lo, hi = _np_halves(got)
    w = words.numpy().view(np.uint32)
    codes = np.stack([(w >> (4 * j)) & 0xF for j in range(8)], axis=1).astype(np.float16)
    assert np.array_equal(lo, codes[:, :4]) and np.array_equal(hi, codes[:, 4:]), backend


def test_half2_gpu_source_compiles_for_sm90():
    """The inline PTX (not the interpreter's emulation) assembles for an sm_90 target."""
    import subprocess
    import sys
    code = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
import torch
import test_half2 as t
from kilnx.codegen.aot import compile_for_target
w = torch.zeros(64, dtype=torch.int32).view(torch.uint32)
ck = compile_for_target(t.decode_nibbles, (w,), {{}})
assert "fma.rn.f16x2" in ck.asm["ptx"], "no packed fma in the PTX"
z = torch.zeros(64)
u = torch.zeros(64, dtype=torch.int32).view(torch.uint32)
ck = compile_for_target(t.half2_ops, (z, z, u, u), {{}})
assert "cvt.f32.f16" in ck.asm["ptx"]
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
