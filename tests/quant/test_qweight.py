"""QWeight: construction from MLX outputs and from dense tensors, dequantization, expert
stacks, bookkeeping, and the validation messages."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from kilnx.quant import QuantFormat, QWeight, dequantize, quantize

mx = pytest.importorskip("mlx.core")

TORCH_TO_MX = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}


def mlx_of(t: torch.Tensor):
    return mx.array(t.float().numpy()).astype(TORCH_TO_MX[t.dtype])


def mlx_to_torch(a) -> torch.Tensor:
    dtype = {v: k for k, v in TORCH_TO_MX.items()}[a.dtype]
    return torch.from_numpy(np.array(a.astype(mx.float32))).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,group_size", [(4, 64), (3, 32), (8, 128)])
def test_quantize_equals_mlx_and_dequantize_matches(bits, group_size, dtype):
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(bits)).to(dtype)
    q = QWeight.quantize(w, bits=bits, group_size=group_size)
    p, s, b = mx.quantize(mlx_of(w), group_size, bits)
    assert torch.equal(q.packed.view(torch.uint32).to(torch.int64), torch.from_numpy(np.array(p).astype(np.int64)))
    assert q.scales.dtype == dtype and q.biases.dtype == dtype and q.dtype == dtype
    assert torch.equal(q.scales, mlx_to_torch(s)) and torch.equal(q.biases, mlx_to_torch(b))
    deq = q.dequantize()
    assert deq.dtype == dtype and deq.shape == (16, 256)
    assert torch.equal(deq, mlx_to_torch(mx.dequantize(p, s, b, group_size, bits)))


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "mxfp8"])
def test_from_mlx_fp_modes(mode):
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(3))
    p, s = mx.quantize(mlx_of(w), mode=mode)[:2]
    q = QWeight.from_mlx(p, s, mode=mode)
    assert q.biases is None and q.scales.dtype == torch.uint8 and q.dtype == torch.bfloat16
    assert q.format == QuantFormat.resolve(mode)
    want = mlx_to_torch(mx.dequantize(p, s, mode=mode))  # MLX's default: bfloat16
    assert torch.equal(q.dequantize(), want)
    want32 = torch.from_numpy(np.array(mx.dequantize(p, s, mode=mode, dtype=mx.float32)))
    assert torch.equal(q.dequantize(torch.float32), want32)
    assert QWeight.quantize(w, mode=mode).packed.equal(q.packed)


def test_nvfp4_global_scale_round_trip():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(4)) * 100
    gs = mx.array(np.float32(w.abs().max()))
    p, s = mx.quantize(mlx_of(w), mode="nvfp4", global_scale=gs)[:2]
    q = QWeight.quantize(w, mode="nvfp4", global_scale=torch.tensor(float(w.abs().max())))
    assert torch.equal(q.scales, torch.from_numpy(np.array(s)))
    want = np.array(mx.dequantize(p, s, mode="nvfp4", global_scale=gs, dtype=mx.float32))
    assert torch.equal(q.dequantize(torch.float32), torch.from_numpy(want))
    assert q.global_scale.dtype == torch.float32 and q.global_scale.shape == ()


def test_expert_stack_indexing_and_shape():
    w = torch.randn(3, 8, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    q = QWeight.quantize(w, bits=4, group_size=32)
    assert q.shape == (3, 8, 128) and q.num_experts == 3 and len(q) == 3
    p, s, b = mx.quantize(mlx_of(w), 32, 4)  # MLX quantizes a 3-D stack per row too
    assert np.array_equal(q.packed.numpy().view(np.uint32), np.array(p))
    one = q[1]
    assert one.shape == (8, 128) and one.num_experts is None
    assert torch.equal(one.dequantize(), QWeight.quantize(w[1], bits=4, group_size=32).dequantize())
    assert torch.equal(q.dequantize()[2], q[-1].dequantize())
    assert q[0:2].shape == (2, 8, 128)
    with pytest.raises(IndexError):
        q[3]
    with pytest.raises(ValueError, match="single matrix"):
        one[0]


def test_bookkeeping_nbytes_format_to_and_module_helpers():
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(6)).half()
    q = quantize(w, bits=5, group_size=64)
    # 32 rows x 256 * 5 / 32 words x 4 bytes + two fp16 tensors of 32 x 4
    assert q.nbytes == 32 * 40 * 4 + 2 * 32 * 4 * 2
    assert q.packed.shape == (32, 40) and q.packed.dtype == torch.int32
    assert (q.mode, q.bits, q.group_size) == ("affine", 5, 64)
    assert q.format == QuantFormat("affine", 5, 64) and hash(q.format) == hash(QuantFormat("affine", 5, 64))
    assert {q.format: "kernel"}[QuantFormat("affine", 5, 64)] == "kernel"
    moved = q.to("cpu")
    assert moved.device == torch.device("cpu") and torch.equal(dequantize(moved), q.dequantize())
    assert q.dequantize(torch.float32).dtype == torch.float32
    assert "affine" in repr(q)


def test_from_mlx_accepts_numpy_and_torch():
    w = np.random.default_rng(7).standard_normal((4, 64)).astype(np.float32)
    p, s, b = (np.array(a) for a in mx.quantize(mx.array(w), 32, 4))
    qn = QWeight.from_mlx(p, s, b, bits=4, group_size=32)
    qt = QWeight.from_mlx(torch.from_numpy(p.view(np.int32)), torch.from_numpy(s), torch.from_numpy(b),
                          bits=4, group_size=32)
    assert torch.equal(qn.dequantize(), qt.dequantize())
    assert qn.shape == (4, 64)


# ----------------------------------------------------------------------------- validation


def _affine_arrays(bits=4, group_size=32):
    w = mx.array(np.random.default_rng(8).standard_normal((4, 128)).astype(np.float32))
    return [np.array(a) for a in mx.quantize(w, group_size, bits)]


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda p, s, b, kw: (p.astype(np.float32), s, b, kw), "uint32"),
        (lambda p, s, b, kw: (p, s[:, :2], b, kw), "scales shape"),
        (lambda p, s, b, kw: (p, s, None, kw), "needs biases"),
        (lambda p, s, b, kw: (p, s, b[:, :2], kw), "biases must match"),
        (lambda p, s, b, kw: (p, s, b, {**kw, "bits": 7}), "bits"),
        (lambda p, s, b, kw: (p, s, b, {**kw, "group_size": 16}), "group_size"),
        (lambda p, s, b, kw: (p, s, b, {**kw, "mode": "int4"}), "unknown quantization mode"),
        (lambda p, s, b, kw: (p[0], s[0], b[0], kw), r"\(N, K\*bits/32\)"),
        (lambda p, s, b, kw: (p, s.astype(np.int32), b.astype(np.int32), kw), "float32/float16/bfloat16"),
    ],
)
def test_from_mlx_rejects_bad_inputs(mutate, message):
    p, s, b = _affine_arrays()
    p, s, b, kw = mutate(p, s, b, {"bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match=message):
        QWeight.from_mlx(p, s, b, **kw)


def test_fp_mode_validation():
    w = mx.array(np.random.default_rng(9).standard_normal((4, 64)).astype(np.float32))
    p, s = (np.array(a) for a in mx.quantize(w, mode="mxfp4")[:2])
    with pytest.raises(ValueError, match="requires bits=4 and group_size=32"):
        QWeight.from_mlx(p, s, mode="mxfp4", group_size=64)
    with pytest.raises(ValueError, match="no biases"):
        QWeight.from_mlx(p, s, s, mode="mxfp4")
    with pytest.raises(ValueError, match="uint8 codes"):
        QWeight.from_mlx(p, s.astype(np.float32), mode="mxfp4")
    with pytest.raises(ValueError, match="only meaningful for nvfp4"):
        QWeight.from_mlx(p, s, mode="mxfp4", global_scale=np.float32(1.0))


def test_quantize_validation():
    with pytest.raises(ValueError, match="multiple of group_size=64"):
        QWeight.quantize(torch.randn(4, 96))
    with pytest.raises(ValueError, match=r"\(N, K\) or \(E, N, K\)"):
        QWeight.quantize(torch.randn(64))
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        QWeight.quantize(torch.ones(4, 64, dtype=torch.int32))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(bits=st.sampled_from([3, 5, 6]), gs=st.sampled_from([32, 64, 128]), experts=st.sampled_from([None, 2]),
       rows=st.sampled_from([1, 5]))
def test_widening_repacks_the_same_codes_so_dequantize_is_unchanged(bits, gs, experts, rows):
    """3/5/6-bit codes straddle words; widened to 4/8 bits they are the same codes (numpy unpack/pack of
    the MLX layout) with the same scales and biases, so the dense weight is bit for bit the same."""
    from kilnx.quant.bitpack import pack_bits, unpack_bits
    shape = (rows, 2 * gs) if experts is None else (experts, rows, 2 * gs)
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(bits * gs + rows))
    q = QWeight.quantize(w, bits=bits, group_size=gs)
    wide = q.widened(4 if bits == 3 else 8)
    codes = unpack_bits(q.packed.numpy().view(np.uint32), bits)
    assert np.array_equal(wide.packed.numpy().view(np.uint32), pack_bits(codes, wide.bits))
    assert torch.equal(wide.dequantize(torch.float32), q.dequantize(torch.float32))
    assert wide.scales is q.scales and wide.shape == q.shape and wide.group_size == gs


def test_widening_is_only_to_more_bits_of_an_affine_weight():
    q = QWeight.quantize(torch.randn(4, 64), bits=4, group_size=32)
    with pytest.raises(ValueError, match="affine weight to more bits"):
        q.widened(4)
