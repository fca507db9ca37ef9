"""Casts in the kernel language on every backend: float to int (toward zero), to bf16 / f16 (nearest even), bool to
int, int to float, fp8 e4m3 stores (saturating, as torch converts), and kd.bitcast building floats from codes."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kilnx.dsl as kd
from dsl_helpers import assert_close, randn

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")

BACKENDS = ["reference", "triton", "numba"]


# ---- casts -------------------------------------------------------------------------------------------
@kd.kernel(tune={"BLOCK": kd.choice(64)})
def casts(x, *, BLOCK):
    n = x.shape[0]
    pid = kd.grid(kd.cdiv(n, BLOCK))
    r = pid * BLOCK + kd.arange(0, BLOCK)
    v = kd.load(x, r)
    as_i32 = kd.output((n,), kd.i32, name="as_i32")
    as_bf16 = kd.output((n,), kd.bf16, name="as_bf16")
    sign = kd.output((n,), kd.i8, name="sign")
    back = kd.output((n,), kd.f32, name="back")
    kd.store(as_i32, r, v.to(kd.i32))                           # truncates toward zero
    kd.store(as_bf16, r, v.to(kd.bf16))                         # rounds to nearest even
    kd.store(sign, r, (v > 0).to(kd.i8) - (v < 0).to(kd.i8))    # bool -> int
    kd.store(back, r, v.to(kd.i32).to(kd.f32) + 0.5)            # int -> float
    return as_i32, as_bf16, sign, back


@kd.kernel(tune={"BLOCK": kd.choice(64)})
def to_f16(x, *, BLOCK):
    n = x.shape[0]
    pid = kd.grid(kd.cdiv(n, BLOCK))
    r = pid * BLOCK + kd.arange(0, BLOCK)
    out = kd.output((n,), kd.f16)
    kd.store(out, r, kd.load(x, r).to(kd.f16))
    return out


CAST_INPUT = torch.cat([randn(90, seed=3, scale=100.0),
                        torch.tensor([0.0, -0.5, 0.5, -2.75, 2.75, 1.0 + 2**-9, 1.0 + 3 * 2**-9])])


@pytest.mark.parametrize("backend", BACKENDS)
def test_casts(backend):
    x = CAST_INPUT
    want = (x.to(torch.int32), x.to(torch.bfloat16), torch.sign(x).to(torch.int8),
            x.to(torch.int32).float() + 0.5)
    got = casts(x, backend=backend, config={})
    for g, w, what in zip(got, want, ("i32", "bf16", "sign", "back")):
        if what in ("i32", "sign"):
            assert g.dtype == w.dtype and torch.equal(g, w), f"{backend} {what}: {g} != {w}"
        elif backend == "triton" and what == "bf16":
            assert_close(g, w, ulps=1, atol=0, what=f"{backend} {what}")   # the interpreter truncates
        else:
            assert_close(g, w, ulps=0, atol=0, what=f"{backend} {what}")    # exact


@pytest.mark.parametrize("backend", BACKENDS)
def test_cast_to_f16_rounds_to_nearest_even(backend):
    x = CAST_INPUT
    assert_close(to_f16(x, backend=backend, config={}), x.to(torch.float16), ulps=0, atol=0, what=backend)


@kd.kernel(tune={"BLOCK": kd.choice(128)})
def through_f8e4(x, *, BLOCK):
    """x stored into an fp8 e4m3 tensor (a KV cache's dtype), then loaded back and widened."""
    n = x.shape[0]
    pid = kd.grid(kd.cdiv(n, BLOCK))
    r = pid * BLOCK + kd.arange(0, BLOCK)
    codes = kd.output((n,), kd.f8e4, name="codes")
    back = kd.output((n,), kd.f32, name="back")
    kd.store(codes, r, kd.load(x, r, mask=r < n), mask=r < n)
    kd.store(back, r, kd.load(codes, r, mask=r < n).to(kd.f32) * 2.0, mask=r < n)
    return codes, back


F8_EDGES = torch.tensor([0.0, -0.0, 448.0, -448.0, 463.9, 464.0, 1e6, -1e6, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11,
                         2.0 ** -6, 1.0 + 2 ** -4, 1.0 + 3 * 2 ** -4, 0.0137])


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 60.0, 600.0]))
def test_f8e4_stores_round_as_torch_converts(backend, seed, scale):
    """fp8 e4m3fn: to nearest even, saturating at +-448 (torch's conversion, and sm_90's cvt.rn.satfinite)."""
    x = torch.cat([randn(200, seed=seed, scale=scale), F8_EDGES])
    codes, back = through_f8e4(x, backend=backend, config={})
    want = x.to(torch.float8_e4m3fn)
    assert codes.dtype == torch.float8_e4m3fn, backend
    assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8)), backend
    assert torch.equal(back, want.float() * 2.0), backend


# ---- kd.bitcast: codes become floats by bit operations alone (the magic-number dequantization) ----
@kd.kernel(tune={"BLOCK": kd.choice(64)})
def magic_codes(q, *, BLOCK):
    n = q.shape[0]
    pid = kd.grid(kd.cdiv(n, BLOCK))
    r = pid * BLOCK + kd.arange(0, BLOCK)
    words = kd.load(q, r)
    f = ((words & 0xF0) | 0x4B000000).bitcast(kd.f32)     # 2^23 + 16 * code, exactly
    codes = kd.output((n,), kd.f32, name="codes")
    bits = kd.output((n,), kd.i32, name="bits")
    kd.store(codes, r, f * (1.0 / 16) - 2.0 ** 19)         # one fma: the code, exactly
    kd.store(bits, r, f.bitcast(kd.i32))                   # and back to the same bits
    return codes, bits


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitcast_builds_floats_from_codes(backend):
    q = torch.randint(-2**31, 2**31 - 1, (100,), dtype=torch.int32, generator=torch.Generator().manual_seed(5))
    codes, bits = magic_codes(q, backend=backend, config={})
    assert torch.equal(codes, ((q >> 4) & 0xF).float()), backend
    assert torch.equal(bits, (q & 0xF0) | 0x4B000000), backend


def test_bitcast_is_only_between_32_bit_types():
    @kd.kernel(tune={})
    def bad(x):
        v = kd.load(x, kd.arange(0, 16))
        out = kd.output((16,), kd.f32)
        kd.store(out, kd.arange(0, 16), v.bitcast(kd.f16).f32())
        return out
    with pytest.raises(kd.DSLError, match="only between 32-bit types"):
        bad(torch.zeros(16, dtype=torch.int32), backend="reference", config={})
