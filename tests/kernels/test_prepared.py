"""Producers that emit qmv_h2's prepared activations (kernels/prepared.py) equal the two-kernel path:
add_rms_norm / silu_mul, then qmv_h2_prep. On every backend, for K not a power of two and every
(bits, group) qmv_h2 serves; and a llama forward through them gives the logits of the plain path."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import activations, norms, prepared
from kilnx.kernels import qmv_h2 as H
from kilnx.quant import QWeight

CPU_ONLY = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                              reason="the CPU tests run Triton kernels under TRITON_INTERPRET=1")


def _x_of(p: prepared.PreparedX) -> torch.Tensor:
    return H._x_of(p.planes, p.xs)


def assert_same_prepared(got: prepared.PreparedX, want_x: torch.Tensor, per: int, group: int):
    """got prepares want_x: the same activations (to one rounding of the norm's fp32 arithmetic) and
    group sums, with exact power-of-two group scales."""
    planes, sums, xs = H._prep_spec(want_x.float(), PER=per, GROUP=group)
    assert got.planes.shape == planes.shape and got.format == (per, group)
    x = _x_of(got)
    tol = 2 ** -7 * want_x.float().abs().amax().item()            # one bf16 ulp of the largest value
    assert (x - want_x.float()).abs().max().item() <= tol
    assert torch.allclose(got.sums, sums, rtol=1e-2, atol=tol * group)
    assert torch.all(got.xs.log2() == got.xs.log2().round())


@CPU_ONLY
@settings(max_examples=6, deadline=None, derandomize=True)
@given(m=st.sampled_from([1, 3]), groups=st.sampled_from([1, 3, 4]), fmt=st.sampled_from([(8, 64), (8, 32), (4, 128)]),
       backend=st.sampled_from(["triton", "numba", "reference"]))
def test_add_rms_norm_prepared_equals_norm_then_prep(m, groups, fmt, backend):
    per, group = fmt
    k = group * groups
    g = torch.Generator().manual_seed(m * 100 + k)
    x, res = (torch.randn(m, k, generator=g) * 3).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    w = (torch.rand(k, generator=g) + 0.5).bfloat16()
    want_h, want_y = norms.add_rms_norm_kernel(x, res, w, eps=1e-5, offset=0.0, backend="reference")
    h, *outs = prepared.add_rms_norm_prep(x, res, w, eps=1e-5, offset=0.0, PER=per, GROUP=group, backend=backend)
    if backend == "triton":    # the interpreter truncates fp32 -> bf16 instead of rounding: one ulp
        assert torch.allclose(h.float(), want_h.float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(h, want_h)
    assert_same_prepared(prepared.PreparedX(*outs, x.dtype), want_y, per, group)


@CPU_ONLY
@settings(max_examples=6, deadline=None, derandomize=True)
@given(m=st.sampled_from([1, 2]), f=st.sampled_from([64, 192, 448]), fmt=st.sampled_from([(8, 64), (4, 64)]),
       backend=st.sampled_from(["triton", "numba", "reference"]))
def test_silu_mul_prepared_equals_silu_mul_then_prep(m, f, fmt, backend):
    """F = 448 is not a multiple of the program's words (BLOCK_KW 16 x 8 codes): the last program's
    words past F must not read `up`."""
    per, group = fmt
    gate_up = (torch.randn(m, 2 * f, generator=torch.Generator().manual_seed(f)) * 2).bfloat16()
    want = activations.silu_mul_kernel(gate_up, backend="reference")
    outs = prepared.silu_mul_prep(gate_up, PER=per, GROUP=group, backend=backend, config={"BLOCK_KW": 16})
    assert_same_prepared(prepared.PreparedX(*outs, gate_up.dtype), want, per, group)


def _qweight(n, k, bits, group, seed=0):
    w = QWeight.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), bits=bits, group_size=group)
    return QWeight.from_mlx(w.packed, w.scales.bfloat16(), w.biases.bfloat16(), bits=bits, group_size=group)


@CPU_ONLY
def test_qmatmul_of_prepared_activations_and_mismatched_formats(monkeypatch):
    from kilnx import ops
    from kilnx.kernels.routing import qmatmul_rows
    x, res = torch.randn(2, 128).bfloat16(), torch.randn(2, 128).bfloat16()
    norm = torch.ones(128).bfloat16()
    w4, w8 = _qweight(24, 128, 4, 64), _qweight(24, 128, 8, 64, seed=1)
    assert ops.prepared_format([w4], x) is None            # the CPU route's GEMV takes plain x
    monkeypatch.setattr(qmatmul_rows, "choice_for", lambda *a: {"QMV_MAX_ROWS": 8, "GEMV": "qmv_h2"})
    assert ops.prepared_format([w4], x) is None           # remembered until tuned configs reload
    from kilnx.dsl.kernel import forget_remembered_configs
    forget_remembered_configs()
    assert ops.prepared_format([w4], x) == (8, 64)
    assert ops.prepared_format([w4, w8], x) is None       # one prepared form cannot serve both
    assert ops.prepared_format([w4], torch.randn(9, 128)) is None   # more rows than the GEMV takes
    h, xp = ops.add_rms_norm_prepared(x, res, norm, 1e-5, (8, 64))
    _, y = ops.add_rms_norm(x, res, norm, 1e-5)
    got, want = ops.qmatmul(xp, w4), ops.qmatmul(y, w4)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 24)
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())
    with pytest.raises(ValueError, match="prepared_format"):
        ops.qmatmul(xp, w8)


@CPU_ONLY
@pytest.mark.parametrize("fused_swiglu", ["1", "0"])
def test_llama_forward_with_prepared_producers_matches_plain(fused_swiglu, monkeypatch):
    """A tiny random 4-bit llama whose GEMVs take prepared activations (forced, as the GPU route does)
    gives the logits of the plain path, and its producers really emitted prepared activations: the SwiGLU
    in gate_up's GEMV (kernels/swiglu_prep.py), or with KILNX_FUSED_SWIGLU=0 in a launch of its own."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent.parent / "runtime"))
    from tiny_models import tiny_model

    from kilnx.kernels import swiglu_prep
    from kilnx.kernels.routing import qmatmul_rows
    from kilnx.runtime.kv_cache import KVCache
    monkeypatch.setenv("TRITON_INTERPRET", "0")       # the numba lowering: the interpreter is slow here
    monkeypatch.setenv("KILNX_FUSED_SWIGLU", fused_swiglu)
    model = tiny_model("llama", ops="kilnx", fmt="q4", seed=3)
    ids, pos = torch.tensor([[5]]), torch.arange(1)[None]     # one row: the fused SwiGLU's route (serves())

    def forward():
        cache = KVCache.for_model(model.config, 1, 8)
        return model.forward(ids, pos, cache, last=-1)

    plain = forward()
    monkeypatch.setattr(qmatmul_rows, "choice_for", lambda *a: {"QMV_MAX_ROWS": 8, "GEMV": "qmv_h2"})
    from kilnx.dsl.kernel import forget_remembered_configs
    forget_remembered_configs()        # as the runtime does when it reloads tuned configs
    made = []
    for module, name in ((prepared, "add_rms_norm_prepared"), (prepared, "silu_mul_prepared"),
                         (swiglu_prep, "swiglu_prepared")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **k: made.append((name, real(*a, **k)))
                            or made[-1][1])
    fused = forward()
    swiglu = [out for name, out in made if name == "swiglu_prepared"]
    producers = sorted(name for name, out in made if name != "swiglu_prepared" or out is not None)
    # 2 layers: 3 residual norms, 2 SwiGLUs (each in gate_up's GEMV, or its own launch)
    assert len(swiglu) == 2 and all((out is not None) == (fused_swiglu == "1") for out in swiglu)
    second = "swiglu_prepared" if fused_swiglu == "1" else "silu_mul_prepared"
    assert producers == ["add_rms_norm_prepared"] * 3 + [second] * 2
    scale = plain.float().abs().max().item()
    assert torch.allclose(fused.float(), plain.float(), rtol=0, atol=3e-2 * scale)


@pytest.mark.gpu
def test_prepared_producers_on_the_gpu_match_the_two_kernel_path():
    """On the GPU (the route's qmv_h2): norm+prep and silu+prep in one launch each, at llama-3.1-8b's
    widths, give the GEMV the activations the separate prep gives it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dev = "cuda"
    for k, f in ((4096, 14336),):
        x, res = torch.randn(1, k, device=dev).bfloat16(), torch.randn(1, k, device=dev).bfloat16()
        w = torch.rand(k, device=dev).bfloat16() + 0.5
        h, xp = prepared.add_rms_norm_prepared(x, res, w, 1e-5, (8, 64))
        want_h, want_y = norms.add_rms_norm(x, res, w, 1e-5)
        assert torch.equal(h, want_h)
        assert torch.allclose(_x_of(xp), want_y.float(), rtol=2 ** -7, atol=0)
        gate_up = torch.randn(3, 2 * f, device=dev).bfloat16()
        sp = prepared.silu_mul_prepared(gate_up, (8, 64))
        planes, sums, xs = H.qmv_h2_prep(activations.silu_mul(gate_up), PER=8, GROUP=64)
        # fp16 planes hold values far below their group's largest as subnormals: compare the two paths
        assert torch.equal(sp.xs, xs) and torch.allclose(sp.sums, sums, rtol=1e-5, atol=1e-5)
        assert torch.allclose(_x_of(sp), H._x_of(planes, xs), rtol=2 ** -7, atol=0)


@pytest.mark.gpu
def test_split_decode_attention_on_the_gpu_matches_the_one_pass_kernel():
    """llama-3.1-8b's heads at batch 1 and 4, contexts of 1 to 3000 keys in a 4096-key cache: the split
    path (taken by ops.attention here) equals the one-pass kernel and the float64 formula."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from kilnx.kernels import attention as A
    from kilnx.kernels import attention_split as AS
    for B, ctx in ((1, 1), (1, 200), (1, 3000), (4, 1500)):
        q, k, v, pos = A._attn_problem_args({"B": B, "T": 1, "Hq": 32, "Hk": 8, "D": 128, "S": 4096, "ctx": ctx}, "cuda")
        assert AS.use_split(q, k)
        got = A.attention(q, k, v, pos, 128 ** -0.5)
        one_pass = A.attention_kernel(q, k, v, pos, **A._kernel_kwargs(q, k, 128 ** -0.5, None, None))
        want = A.attention_formula(q, k, v, pos, 128 ** -0.5)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got.float(), one_pass.float(), rtol=2e-2, atol=2e-2)
        xp = A.attention(q, k, v, pos, 128 ** -0.5, prepared=(8, 64))      # the merge writes o's input
        assert isinstance(xp, prepared.PreparedX) and xp.shape == (B, 32 * 128)
        torch.testing.assert_close(_x_of(xp), got.reshape(B, -1).float(), rtol=2 ** -7, atol=1e-3)
