"""The library's row fusions (kilnx/kernels/norms.py, activations.py) against torch-eager formulas.

Every kernel, in both lowerings (persistent: the row fits in BLOCK_D; looped: BLOCK_D is narrower
than the row, one pass per reduction), over random shapes (a single row, non-power-of-two widths,
leading batch dims), fp32/fp16/bf16 and several configs from its space: the Triton kernel (run by
the Triton interpreter) = the numpy reference interpreter = numba = the formula written below in
torch, within the output dtype's tolerance.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dsl_helpers import DTYPES, assert_close, randn
from kilnx.kernels import activations as A
from kilnx.kernels import norms as N

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")

FEW = settings(max_examples=6, deadline=None, derandomize=True)


# ---- the specification: each kernel's meaning as a torch formula (fp32 math, rounded once) ----------
def rms(h, w, eps, offset):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.float())


def halves(gu):
    f = gu.shape[-1] // 2
    return gu.float()[..., :f], gu.float()[..., f:]


@dataclass
class Case:
    kernel: object
    make: Callable            # (lead shape, width, dtype, seed) -> input tensors
    scalars: dict
    formula: Callable         # (*inputs, **scalars) -> fp32 tensor or tuple (or int64 indices)


def rows(lead, d, dt, seed, n, vectors=0, scale=1.0, shift=0.0, vec_shift=1.0):
    ts = [randn(*lead, d, dtype=dt, seed=seed + i, scale=scale, shift=shift) for i in range(n)]
    vs = [randn(d, dtype=dt, seed=seed + 100 + i, scale=0.5, shift=vec_shift) for i in range(vectors)]
    return tuple(ts + vs)


CASES = {
    "rms_norm": Case(
        N.rms_norm_kernel,
        lambda lead, d, dt, s: rows(lead, d, dt, s, 1, vectors=1),
        dict(eps=1e-6, offset=0.0),
        lambda x, w, eps, offset: rms(x.float(), w, eps, offset)),
    "rms_norm_gemma": Case(   # gemma stores zero-centred weights and scales by (1 + w)
        N.rms_norm_kernel,
        lambda lead, d, dt, s: rows(lead, d, dt, s, 1, vectors=1, vec_shift=0.0),
        dict(eps=1e-6, offset=1.0),
        lambda x, w, eps, offset: rms(x.float(), w, eps, 1.0)),
    "add_rms_norm": Case(
        N.add_rms_norm_kernel,
        lambda lead, d, dt, s: rows(lead, d, dt, s, 2, vectors=1),
        dict(eps=1e-5, offset=0.0),
        lambda x, res, w, eps, offset: (x.float() + res.float(),
                                        rms(x.float() + res.float(), w, eps, offset))),
    "add_rms_norm_gemma": Case(
        N.add_rms_norm_kernel,
        lambda lead, d, dt, s: rows(lead, d, dt, s, 2, vectors=1, vec_shift=0.0),
        dict(eps=1e-6, offset=1.0),
        lambda x, res, w, eps, offset: (x.float() + res.float(),
                                        rms(x.float() + res.float(), w, eps, 1.0))),
    "layer_norm": Case(       # shifted inputs: the mean matters
        N.layer_norm_kernel,
        lambda lead, d, dt, s: (randn(*lead, d, dtype=dt, seed=s, shift=3.0),
                                randn(d, dtype=dt, seed=s + 1, shift=1.0), randn(d, dtype=dt, seed=s + 2)),
        dict(eps=1e-5),
        lambda x, w, b, eps: F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), eps)),
    "silu_mul": Case(
        A.silu_mul_kernel,
        lambda lead, d, dt, s: rows(lead, 2 * d, dt, s, 1, scale=2.0),
        {},
        lambda gu: F.silu(halves(gu)[0]) * halves(gu)[1]),
    "gelu_tanh_mul": Case(
        A.gelu_tanh_mul_kernel,
        lambda lead, d, dt, s: rows(lead, 2 * d, dt, s, 1, scale=2.0),
        {},
        lambda gu: F.gelu(halves(gu)[0], approximate="tanh") * halves(gu)[1]),
    "softcap": Case(          # values well past the cap, so tanh saturates
        A.softcap_kernel,
        lambda lead, d, dt, s: rows(lead, d, dt, s, 1, scale=40.0),
        dict(cap=30.0),
        lambda x, cap: cap * torch.tanh(x.float() / cap)),
    "scaled_add": Case(
        A.scaled_add_kernel,
        lambda lead, d, dt, s: rows(lead, d, dt, s, 2),
        dict(scale=0.375),
        lambda x, res, scale: res.float() + scale * x.float()),
    "argmax": Case(
        A.argmax_kernel,
        lambda lead, d, dt, s: rows(lead, d, dt, s, 1),
        {},
        lambda x: torch.argmax(x.float(), dim=-1)),
}


def expected(case: Case, args):
    out = case.formula(*args, **case.scalars)
    if isinstance(out, tuple):
        return tuple(o.to(args[0].dtype) for o in out)
    return out if case.kernel is A.argmax_kernel else out.to(args[0].dtype)


def check(case: Case, got, want, what: str):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want), f"{what}: {len(got)} outputs, expected {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        if case.kernel is A.argmax_kernel:
            assert g.shape == w.shape and g.dtype == torch.int32, f"{what}: {g.shape} {g.dtype}"
            assert torch.equal(g.long(), w), f"{what}: indices {g.tolist()} != {w.tolist()}"
        else:
            assert_close(g, w, what=f"{what} output {k}")


def config(lowering: str, width: int, rows_per_program: int, warps: int) -> dict:
    if lowering == "looped":
        assert width > 64
        return {"ROWS": rows_per_program, "BLOCK_D": 64, "num_warps": warps}
    return {"ROWS": rows_per_program, "BLOCK_D": max(64, 1 << (width - 1).bit_length()), "num_warps": warps}


LEADS = [(1,), (3,), (2, 3)]          # one row; several; leading batch dims
ALL_LEADS = LEADS + [()]              # and a single row given as a vector
WIDTHS = {"persistent": [1, 40, 100, 257], "looped": [100, 257]}  # looped: at least two column chunks


# ---- Triton (interpreter) = reference = torch, every kernel, both lowerings ----------------------------
@pytest.mark.parametrize("lowering", ["persistent", "looped"])
@pytest.mark.parametrize("name", list(CASES))
@FEW
@given(data=st.data())
def test_triton_and_reference_match_torch(name, lowering, data):
    case = CASES[name]
    lead = data.draw(st.sampled_from(ALL_LEADS), "lead")
    width = data.draw(st.sampled_from(WIDTHS[lowering]), "width")
    dt = DTYPES[data.draw(st.sampled_from(list(DTYPES)), "dtype")]
    cfg = config(lowering, width, data.draw(st.sampled_from([1, 2, 4]), "ROWS"),
                 data.draw(st.sampled_from([1, 4]), "num_warps"))
    seed = data.draw(st.integers(0, 1000), "seed")
    args = case.make(lead, width, dt, seed)
    want = expected(case, args)
    ref = case.kernel(*args, backend="reference", config=cfg, **case.scalars)
    tri = case.kernel(*args, backend="triton", config=cfg, **case.scalars)
    check(case, ref, want, "reference vs torch")
    check(case, tri, want, "triton vs torch")
    check(case, tri, ref, "triton vs reference")


def test_default_config_is_persistent_and_space_has_looped_configs():
    x = randn(4, 300)
    cfg = N.rms_norm_kernel.default_config(x, randn(300))
    assert cfg["BLOCK_D"] >= 300
    src_persistent = N.rms_norm_kernel.triton_source(x, randn(300), config=cfg, eps=1e-6, offset=0.0)
    src_looped = N.rms_norm_kernel.triton_source(x, randn(300), config=config("looped", 300, 1, 1),
                                                 eps=1e-6, offset=0.0)
    assert "for " not in src_persistent
    # one pass for the sum of squares and one that stores
    assert src_looped.count("for ") == 2


# ---- numba = reference = torch ----------------------------------------------------------------------
# Each numba specialisation (kernel x dtype x config) compiles once per machine (it is cached on disk)
# and that compile takes seconds, so every kernel gets one or two: together they cover both lowerings
# and the three float types (16-bit floats travel as their raw bits and are converted in registers).
# The gemma cases differ only in runtime scalars, so they reuse their kernel's specialisation.
NUMBA_SPECS = [
    ("rms_norm", "bf16", "looped"), ("rms_norm_gemma", "bf16", "looped"), ("rms_norm", "f16", "persistent"),
    ("silu_mul", "f16", "looped"),
    ("add_rms_norm", "f32", "persistent"), ("add_rms_norm_gemma", "f32", "persistent"),
    ("layer_norm", "bf16", "looped"), ("silu_mul", "bf16", "persistent"),
    ("gelu_tanh_mul", "f32", "looped"), ("softcap", "f32", "persistent"),
    ("scaled_add", "bf16", "looped"), ("argmax", "f32", "looped"),
]
NUMBA_CONFIG = {"looped": {"ROWS": 2, "BLOCK_D": 64, "num_warps": 4},
                "persistent": {"ROWS": 2, "BLOCK_D": 512, "num_warps": 4}}


@pytest.mark.parametrize("name,dtype,lowering", NUMBA_SPECS)
@settings(max_examples=3, deadline=None, derandomize=True)
@given(lead=st.sampled_from(LEADS), width=st.sampled_from([100, 257]), seed=st.integers(0, 1000))
def test_numba_matches_reference_and_torch(name, dtype, lowering, lead, width, seed):
    case = CASES[name]
    cfg = NUMBA_CONFIG[lowering]
    args = case.make(lead, width, DTYPES[dtype], seed)
    nb = case.kernel(*args, backend="numba", config=cfg, **case.scalars)
    ref = case.kernel(*args, backend="reference", config=cfg, **case.scalars)
    check(case, nb, expected(case, args), "numba vs torch")
    check(case, nb, ref, "numba vs reference")


# ---- public wrappers ------------------------------------------------------------------------------
def test_public_ops_are_the_kernels():
    from kilnx import ops
    x, res, w = randn(2, 3, 100, seed=1), randn(2, 3, 100, seed=2), randn(100, seed=3)
    assert_close(ops.rms_norm(x, w, 1e-6, weight_offset=1.0), rms(x, w, 1e-6, 1.0), what="ops.rms_norm")
    h, y = ops.add_rms_norm(x, res, w, 1e-6)
    assert_close(h, x + res, what="ops.add_rms_norm h")
    assert_close(y, rms(x + res, w, 1e-6, 0.0), what="ops.add_rms_norm y")
    assert_close(ops.softcap(x * 50, 30), 30 * torch.tanh(x * 50 / 30), what="ops.softcap")
    assert_close(ops.scaled_add(x, res, 2), res + 2 * x, what="ops.scaled_add")
    am = ops.argmax(x)
    assert am.dtype == torch.int64 and torch.equal(am, torch.argmax(x, -1))


# ---- gemma: RMSNorm with (1 + w) before and after a block ---------------------------------------------
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("block_d", [64, 128], ids=["looped", "persistent"])
def test_gemma_sandwich_norm(dtype, block_d):
    """out = x + post_norm(mlp(pre_norm(x))) with gemma's zero-centred norm weights, scaled by (1 + w).

    Each kernel is checked against the torch formula on the same inputs it received (in bf16 a one-ulp
    difference early on would otherwise be amplified by the matmuls in between); in fp32 the whole
    chain also equals the formula end to end."""
    dt, D, Fh = DTYPES[dtype], 96, 80
    x = randn(2, 3, D, dtype=dt, seed=10)
    w_pre, w_post = randn(D, dtype=dt, seed=11, scale=0.1), randn(D, dtype=dt, seed=12, scale=0.1)
    w_gu, w_down = randn(2 * Fh, D, seed=13, scale=D ** -0.5), randn(D, Fh, seed=14, scale=Fh ** -0.5)
    cfg = {"ROWS": 2, "BLOCK_D": block_d, "num_warps": 1}

    def gemma_norm(v, w):
        v = v.float()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(dt)

    def mlp_up(a):
        return (a.float() @ w_gu.T).to(dt)

    def mlp_down(m):
        return (m.float() @ w_down.T).to(dt)

    for backend in ("reference", "triton"):
        a = N.rms_norm_kernel(x, w_pre, backend=backend, config=cfg, eps=1e-6, offset=1.0)
        assert_close(a, gemma_norm(x, w_pre), what=f"{backend} pre-norm")
        gu = mlp_up(a)
        m = A.silu_mul_kernel(gu, backend=backend, config=cfg)
        assert_close(m, (F.silu(gu.float()[..., :Fh]) * gu.float()[..., Fh:]).to(dt), what=f"{backend} mlp")
        o = mlp_down(m)
        p = N.rms_norm_kernel(o, w_post, backend=backend, config=cfg, eps=1e-6, offset=1.0)
        assert_close(p, gemma_norm(o, w_post), what=f"{backend} post-norm")
        out = A.scaled_add_kernel(p, x, backend=backend, config=cfg, scale=1.0)
        assert_close(out, (x.float() + p.float()).to(dt), what=f"{backend} residual")
        if dt == torch.float32:
            want = x + gemma_norm(mlp_down(F.silu(mlp_up(gemma_norm(x, w_pre))[..., :Fh])
                                          * mlp_up(gemma_norm(x, w_pre))[..., Fh:]), w_post)
            assert_close(out, want, atol=1e-4, what=f"{backend} end to end")
    zero = torch.zeros(D, dtype=dt)
    plain = N.rms_norm_kernel(x, zero, backend="triton", config=cfg, eps=1e-6, offset=1.0)
    assert_close(plain, (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt),
                 what="offset=1 with zero weights is a plain RMS normalisation")


# ---- argmax: first index wins on ties, across column chunks, over a vocabulary wider than a block ----
ARGMAX_CONFIGS = [{"ROWS": 1, "BLOCK_D": 64, "num_warps": 1},       # looped: 16 chunks of 1000
                  {"ROWS": 2, "BLOCK_D": 1024, "num_warps": 4}]     # persistent


def tie_rows(dt):
    V = 1000
    x = torch.zeros(6, V, dtype=dt)
    x[0, [5, 6, 900]] = 3.0                    # tie inside the first chunk and a later one
    x[1, [70, 130, 999]] = 2.5                 # tie across chunks, none in chunk 0
    x[2, :] = 1.0                              # the whole row ties: index 0
    x[3, [999]] = 7.0                          # the maximum in the partial last chunk
    x[4, :] = float("-inf")                    # nothing beats -inf: index 0
    x[5] = randn(V, dtype=dt, seed=5).clamp(max=2.0)   # ties at the clamp, first one wins
    return x


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("cfg", ARGMAX_CONFIGS, ids=["looped", "persistent"])
def test_argmax_ties_first_index_wins(dtype, cfg):
    x = tie_rows(DTYPES[dtype])
    want = torch.tensor([5, 70, 0, 999, 0, int(torch.argmax(x[5].float()))])
    assert int((x[5].float() == 2.0).sum()) >= 2, "row 5 must have a tie to mean anything"
    assert torch.equal(torch.argmax(x.float(), -1), want)   # torch agrees: first index
    for backend in ("reference", "triton"):
        got = A.argmax_kernel(x, backend=backend, config=cfg)
        assert torch.equal(got.long(), want), f"{backend}: {got.tolist()} != {want.tolist()}"


def test_argmax_ties_numba():
    x = tie_rows(torch.float32)
    got = A.argmax_kernel(x, backend="numba", config=NUMBA_CONFIG["looped"])
    assert torch.equal(got.long(), torch.argmax(x, -1))


@settings(max_examples=4, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), rows=st.sampled_from([1, 3]))
def test_argmax_over_vocabulary_wider_than_a_block(seed, rows):
    V = 3000   # 47 chunks of 64; bf16 makes ties frequent
    x = randn(rows, V, dtype=torch.bfloat16, seed=seed, scale=3.0)
    want = torch.argmax(x.float(), -1)
    for cfg in ({"ROWS": 1, "BLOCK_D": 64, "num_warps": 1}, {"ROWS": 1, "BLOCK_D": 4096, "num_warps": 4}):
        got = A.argmax_kernel(x, backend="triton", config=cfg)
        assert torch.equal(got.long(), want), cfg


def test_one_config_serves_rows_narrower_and_wider_than_the_block():
    """A config compiled for a row that fits in BLOCK_D (persistent) must not be reused for a row that
    does not (looped): regression for a compiled-kernel cache keyed without the lowering."""
    cfg = {"ROWS": 1, "BLOCK_D": 64, "num_warps": 1}
    for width in (10, 100, 10):
        x, w = randn(2, width, seed=width), randn(width, seed=1)
        for backend in ("reference", "triton"):
            got = N.rms_norm_kernel(x, w, backend=backend, config=cfg, eps=1e-6, offset=0.0)
            assert_close(got, rms(x, w, 1e-6, 0.0), what=f"{backend} width {width}")
