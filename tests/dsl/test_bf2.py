"""Packed bf16 pairs and byte permutes (kd.bf2_fma, kd.bf2_half, kd.byte_perm).

Specification: bf2_fma computes a*b + c per bf16 half with ONE rounding to bf16, nearest even (the GPU's
fma.rn.bf16x2), for normal values; bf2_half is the bf16 value held in half h of a pair; byte_perm is
PTX prmt.b32's default mode. Every backend must give the bits computed independently here, including the
decode of a 4-bit MLX word into bf16 element pairs that the packed quantized GEMM uses.
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
def bf2_ops(a, b, c, sel, *, BLOCK):
    n = a.shape[0]
    r = kd.grid(kd.cdiv(n, BLOCK)) * BLOCK + kd.arange(0, BLOCK)
    fma = kd.bf2_fma(kd.load(a, r), kd.load(b, r), kd.load(c, r))
    halves = kd.bf2_half(fma[:, None], kd.arange(0, 2)[None, :])
    perm = kd.byte_perm(kd.load(a, r), kd.load(b, r), kd.load(sel, r))
    out_fma = kd.output((n,), kd.u32, name="fma")
    out_halves = kd.output((n, 2), kd.f32, name="halves")
    out_perm = kd.output((n,), kd.u32, name="perm")
    kd.store(out_fma, r, fma)
    kd.store(out_halves, r[:, None], kd.arange(0, 2)[None, :], halves)
    kd.store(out_perm, r, perm)
    return out_fma, out_halves, out_perm


def _bf16(bits):
    return (np.asarray(bits, np.uint32) << 16).view(np.float32).astype(np.float64)


def _bf16_rne(x):
    """float64 -> bf16 bits, by exact rational comparison of the two neighbours (independent of the ops)."""
    out = []
    for v in np.asarray(x, np.float64).ravel():
        f = np.float32(v)                       # nearest fp32; its bf16 neighbours bracket v
        b = int(np.array(f).view(np.uint32)) >> 16
        cands = [b - 1, b, b + 1]
        vals = [float(_bf16(c & 0xFFFF)) for c in cands]
        err = [abs(w - v) for w in vals]
        best = min(err)
        ties = [c for c, e in zip(cands, err) if e == best]
        out.append([c for c in ties if c % 2 == 0][0] if len(ties) > 1 else ties[0])
    return np.array(out, np.uint32).reshape(np.shape(x)) & 0xFFFF


def _normal_bf16_bits(rng, n, scale):
    v = (rng.standard_normal(n) * scale).astype(np.float32)
    v[np.abs(v) < 1e-30] = 1.0
    return (v.view(np.uint32) >> 16).astype(np.uint32)


def _prmt(a, b, sel):
    """prmt.b32 from the PTX manual's table, one lane at a time."""
    out = []
    for x, y, s in zip(a.tolist(), b.tolist(), sel.tolist()):
        src = x.to_bytes(4, "little") + y.to_bytes(4, "little")
        r = bytearray(4)
        for i in range(4):
            nib = (s >> (4 * i)) & 15
            byte = src[nib & 7]
            r[i] = (0xFF if byte & 0x80 else 0) if nib & 8 else byte
        out.append(int.from_bytes(bytes(r), "little"))
    return np.array(out, np.uint32)


def _u32(a):
    return torch.from_numpy(np.asarray(a, np.uint32).view(np.int32)).view(torch.uint32)


def _bits(t):
    return t.cpu().view(torch.int32).numpy().view(np.uint32)


def _check(seed, scale, backends, device="cpu"):
    rng = np.random.default_rng(seed)
    n = 96
    a = _normal_bf16_bits(rng, n, scale) | (_normal_bf16_bits(rng, n, scale) << 16)
    b = _normal_bf16_bits(rng, n, 1.0) | (_normal_bf16_bits(rng, n, 1.0) << 16)
    c = _normal_bf16_bits(rng, n, scale) | (_normal_bf16_bits(rng, n, scale) << 16)
    sel = rng.integers(0, 2**16, n, dtype=np.uint32)
    lo = _bf16_rne(_bf16(a & 0xFFFF) * _bf16(b & 0xFFFF) + _bf16(c & 0xFFFF))
    hi = _bf16_rne(_bf16(a >> 16) * _bf16(b >> 16) + _bf16(c >> 16))
    want_fma = lo | (hi << 16)
    for backend in backends:
        fma, halves, perm = bf2_ops(*[_u32(v).to(device) for v in (a, b, c, sel)], backend=backend, config={})
        assert np.array_equal(_bits(fma), want_fma), f"{backend} bf2_fma"
        assert np.array_equal(halves.cpu().numpy(), np.stack([_bf16(lo), _bf16(hi)], 1).astype(np.float32)), \
            f"{backend} bf2_half"
        assert np.array_equal(_bits(perm), _prmt(a, b, sel)), f"{backend} byte_perm"


@on_cpu
@settings(max_examples=4, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 300.0]))
def test_bf2_ops_give_the_independent_bits(seed, scale):
    _check(seed, scale, BACKENDS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("seed,scale", [(0, 1e-3), (1, 1.0), (2, 300.0)])
def test_bf2_ptx_gives_the_reference_bits_on_gpu(seed, scale):
    _check(seed, scale, ["triton"], device="cuda")


@kd.kernel(tune={"BLOCK": kd.choice(16)})
def decode_bf16(words, scale_bits, bias_bits, *, BLOCK):
    """Each 4-bit MLX word -> its 8 elements q * s + b as bf16, in order: code pair p (elements 2p, 2p + 1,
    the low and high nibble of byte p) from one byte permute, one mask and two bf16x2 FMAs. (bf16 has 7
    mantissa bits, so the high nibble cannot stay in place as 16 q, the fp16 trick: byte p of w >> 4 brings
    it down to bits 16-19.)"""
    n = words.shape[0]
    r = kd.grid(kd.cdiv(n, BLOCK)) * BLOCK + kd.arange(0, BLOCK)
    w = kd.broadcast_to(kd.load(words, r)[:, None], (BLOCK, 4))
    p = kd.arange(0, 4)[None, :]
    t = kd.byte_perm(w, w >> 4, p * 0x1111 + 0x4400)       # byte p of w into byte 0, of w >> 4 into byte 2
    q = kd.bf2_fma((t & 0x000F000F) | 0x43004300, 0x3F803F80, 0xC300C300)   # (128 + q, 128 + q') - 128
    s2 = kd.load(scale_bits, r)[:, None] * 0x10001
    b2 = kd.load(bias_bits, r)[:, None] * 0x10001
    out = kd.output((n, 8), kd.f32)
    elems = kd.bf2_half(kd.bf2_fma(q, s2, b2)[:, :, None], kd.arange(0, 2)[None, None, :])
    kd.store(out, r[:, None], kd.arange(0, 8)[None, :], kd.reshape(elems, (BLOCK, 8)))
    return out


def _check_decode(backends, device="cpu"):
    rng = np.random.default_rng(7)
    n = 32
    words = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    s = _normal_bf16_bits(rng, n, 0.02)
    b = _normal_bf16_bits(rng, n, 0.1)
    codes = np.stack([(words >> (4 * j)) & 0xF for j in range(8)], 1).astype(np.float64)
    want = _bf16(_bf16_rne(codes * _bf16(s)[:, None] + _bf16(b)[:, None])).astype(np.float32)
    for backend in backends:
        got = decode_bf16(_u32(words).to(device), _u32(s).to(device), _u32(b).to(device), backend=backend, config={})
        assert np.array_equal(got.cpu().numpy(), want), backend


@on_cpu
def test_4_bit_words_decode_to_bf16_elements_in_order():
    _check_decode(BACKENDS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_4_bit_words_decode_to_bf16_elements_on_gpu():
    _check_decode(["triton"], device="cuda")


def test_bf2_gpu_source_compiles_for_sm90():
    """The inline PTX (not the interpreter's emulation) assembles for an sm_90 target: one prmt and two
    bf16x2 FMAs per code pair in the decode."""
    import subprocess
    import sys
    code = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
import torch
import test_bf2 as t
from kilnx.codegen.aot import compile_for_target
u = torch.zeros(64, dtype=torch.int32).view(torch.uint32)
ck = compile_for_target(t.decode_bf16, (u, u, u), {{}})
ptx = ck.asm["ptx"]
assert "fma.rn.bf16x2" in ptx and "prmt.b32" in ptx, "no packed bf16 fma or byte permute in the PTX"
ck = compile_for_target(t.bf2_ops, (u, u, u, u), {{}})
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@kd.kernel(tune={"BLOCK": kd.choice(8)})
def interleave(a, b, *, BLOCK):
    r = kd.grid(1) * BLOCK + kd.arange(0, BLOCK)
    both = kd.join(kd.load(a, r[:, None], kd.arange(0, 4)[None, :]), kd.load(b, r[:, None], kd.arange(0, 4)[None, :]))
    out = kd.output((BLOCK, 8), a.dtype)
    kd.store(out, r[:, None], kd.arange(0, 8)[None, :], kd.reshape(both, (BLOCK, 8)))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_join_puts_its_tiles_side_by_side_along_a_new_last_axis(backend):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels run on CPU only under TRITON_INTERPRET=1")
    a, b = torch.arange(32.0).reshape(8, 4), -torch.arange(32.0).reshape(8, 4)
    got = interleave(a, b, backend=backend, config={})
    assert torch.equal(got, torch.stack([a, b], -1).reshape(8, 8)), backend


def test_join_refuses_tiles_of_different_shapes():
    @kd.kernel
    def bad(a):
        kd.grid(1)
        out = kd.output((4, 2), kd.f32)
        kd.store(out, kd.arange(0, 4)[:, None], kd.arange(0, 2)[None, :],
                 kd.join(kd.load(a, kd.arange(0, 4)), kd.load(a, kd.arange(0, 2))))
        return out

    with pytest.raises(kd.DSLError, match="kd.join takes two tiles of one shape"):
        bad(torch.zeros(4), backend="reference")


def test_the_packed_decode_serves_4_bit_codes_with_bf16_activations_and_scales():
    """The kernels ask with their trace's dtype names, the defaults with the tensors' torch dtypes: alike."""
    from kilnx.kernels.bf16_decode import serves
    for x, s in [("bf16", "bf16"), (torch.bfloat16, torch.bfloat16)]:
        assert serves(4, x, s) and not serves(8, x, s)
    for x, s in [("f16", "bf16"), (torch.bfloat16, torch.float32), (torch.float32, "bf16")]:
        assert not serves(4, x, s)
