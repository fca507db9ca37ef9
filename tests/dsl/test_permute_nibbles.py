"""kd.permute reorders a tile's axes as np.transpose does; kd.nibbles decodes the two 4-bit codes of each
byte to bf16 (128 + q exactly, or q * s + b rounded once): the same values on every backend."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kilnx.dsl as kd
from kilnx.dsl import opdefs

BACKENDS = ["reference", "triton", "numba"]


def _skip_triton(backend):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels run on CPU only under TRITON_INTERPRET=1")


@kd.kernel(tune={"BLOCK": kd.choice(64)})
def regroup(x, *, BLOCK):
    """A 1-d load of 64 values regrouped as the tc GEMV's bytes are: (2, 4, 2, 4) -> axes (0, 3, 1, 2)."""
    kd.grid(1)
    e = kd.arange(0, BLOCK)
    t = kd.reshape(kd.permute(kd.reshape(kd.load(x, e), (2, 4, 2, 4)), (0, 3, 1, 2)), (8, 8))
    out = kd.output((8, 8), x.dtype)
    kd.store(out, kd.arange(0, 8)[:, None], kd.arange(0, 8)[None, :], t)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_permute_is_numpys_transpose(backend):
    _skip_triton(backend)
    x = torch.arange(64, dtype=torch.float32)
    want = x.reshape(2, 4, 2, 4).permute(0, 3, 1, 2).reshape(8, 8)
    assert torch.equal(regroup(x, backend=backend, config={}), want)


def test_permute_refuses_what_is_not_a_permutation():
    @kd.kernel
    def bad(x):
        kd.grid(1)
        out = kd.output((4, 4), kd.f32)
        kd.store(out, kd.arange(0, 4)[:, None], kd.arange(0, 4)[None, :],
                 kd.permute(kd.reshape(kd.load(x, kd.arange(0, 16)), (4, 4)), (0, 0)))
        return out

    with pytest.raises(kd.DSLError, match="kd.permute of a 2-d tile takes a permutation"):
        bad(torch.zeros(16), backend="reference")


@kd.kernel(tune={"BLOCK": kd.choice(32)})
def decode(byt, s, b, *, SCALED: kd.constexpr, BLOCK):
    kd.grid(1)
    r, c = kd.arange(0, 4)[:, None], kd.arange(0, BLOCK // 4)[None, :]
    tile = kd.load(byt, r, c)
    if SCALED:
        v = kd.nibbles(tile, kd.load(s, kd.arange(0, 4))[:, None], kd.load(b, kd.arange(0, 4))[:, None])
    else:
        v = kd.nibbles(tile)
    out = kd.output((4, BLOCK // 2), kd.bf16)
    kd.store(out, r, kd.arange(0, BLOCK // 2)[None, :], kd.reshape(v, (4, BLOCK // 2)))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_nibbles_give_the_codes_in_order(backend, seed):
    _skip_triton(backend)
    g = torch.Generator().manual_seed(seed)
    byt = torch.randint(0, 256, (4, 8), generator=g, dtype=torch.uint8)
    s = (torch.rand(4, generator=g) * 0.1 + 0.01).bfloat16()
    b = (-8 * s.float() + torch.randn(4, generator=g) * 0.01).bfloat16()
    q = torch.stack([byt & 15, byt >> 4], -1).reshape(4, 16).double()
    magic = decode(byt, s, b, SCALED=False, backend=backend, config={})
    assert torch.equal(magic.double(), 128 + q)
    scaled = decode(byt, s, b, SCALED=True, backend=backend, config={})
    want = (q * s.double()[:, None] + b.double()[:, None])
    want = torch.from_numpy(opdefs._bf16_of_bits(opdefs._bf16_bits_of(want.numpy()))).bfloat16()
    assert torch.equal(scaled, want), (scaled - want).abs().max()


def test_nibbles_take_bytes_and_both_or_neither_of_scale_and_bias():
    @kd.kernel
    def words(x):
        kd.grid(1)
        out = kd.output((4, 2), kd.bf16)
        kd.store(out, kd.arange(0, 4)[:, None], kd.arange(0, 2)[None, :], kd.nibbles(kd.load(x, kd.arange(0, 4))))
        return out

    with pytest.raises(kd.DSLError, match="kd.nibbles decodes u8 tiles"):
        words(torch.zeros(4, dtype=torch.int32), backend="reference")

    @kd.kernel
    def half(x, s):
        kd.grid(1)
        out = kd.output((4, 2), kd.bf16)
        kd.store(out, kd.arange(0, 4)[:, None], kd.arange(0, 2)[None, :],
                 kd.nibbles(kd.load(x, kd.arange(0, 4)), kd.load(s, kd.arange(0, 4))))
        return out

    with pytest.raises(kd.DSLError, match="both scale and bias"):
        half(torch.zeros(4, dtype=torch.uint8), torch.zeros(4), backend="reference")


@pytest.mark.gpu
@pytest.mark.parametrize("scaled", [False, True])
def test_nibbles_asm_gives_the_reference_values_on_gpu(scaled):
    g = torch.Generator().manual_seed(3)
    byt = torch.randint(0, 256, (4, 8), generator=g, dtype=torch.uint8)
    s = (torch.rand(4, generator=g) * 0.1 + 0.01).bfloat16()
    b = (-8 * s.float()).bfloat16()
    want = decode(byt, s, b, SCALED=scaled, backend="reference", config={})
    got = decode(byt.cuda(), s.cuda(), b.cuda(), SCALED=scaled, config={}).cpu()
    assert torch.equal(got, want)
