"""The quantized embedding lookup: rows of an affine table dequantized on the fly, equal to the rows of
QWeight.dequantize (the format's numpy reference) rounded to the model dtype, times the embedding scale,
on every backend."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels.embedding import embedding_quant
from kilnx.quant import QWeight


def _backends():
    return ["reference", "numba"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


@settings(max_examples=8, deadline=None, derandomize=True)
@given(bits=st.sampled_from([2, 4, 8]), gs=st.sampled_from([32, 64, 128]), groups=st.integers(1, 5),
       tokens=st.integers(1, 9), scale=st.sampled_from([1.0, 25.298221281347036]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_quantized_rows_are_the_dequantized_tables_rows(bits, gs, groups, tokens, scale, dtype):
    g = torch.Generator().manual_seed(bits * 1000 + gs + groups)
    w = QWeight.quantize(torch.randn(37, gs * groups, generator=g), bits=bits, group_size=gs)
    ids = torch.randint(0, 37, (tokens,), generator=g)
    held = float(torch.tensor(scale, dtype=dtype))      # the factor as dtype holds it (the caller rounds it)
    want = (w.dequantize(torch.float32)[ids].to(dtype) * torch.tensor(held, dtype=dtype)).double()
    for backend in _backends():
        got = embedding_quant(w, ids, held, dtype, backend=backend)
        assert got.dtype == dtype and got.shape == want.shape, backend
        # a rounding of the output dtype apart at most; two on Triton's interpreter, which truncates the bf16
        # casts (after the dequantization and at the store)
        ulp = 2.0 ** -6 if dtype == torch.bfloat16 else 2.0 ** -20
        assert (got.double() - want).abs().max().item() <= ulp * (want.abs().max().item() + 1), backend


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_rows_on_the_gpu(bits, dtype):
    """The lookup's Triton kernel compiled for the GPU gives the reference's rows to one rounding of the
    output dtype. The GPU fuses q * s + b into one FMA, skipping the product's rounding: in fp32 the two
    differ by up to an ulp of |q * s| + |b| (3e-6 at the first run on the H200), times the scale."""
    w = QWeight.quantize(torch.randn(300, 640), bits=bits, group_size=32)
    w = QWeight.from_mlx(w.packed, w.scales.to(dtype), w.biases.to(dtype), bits=bits, group_size=32).to("cuda")
    ids = torch.tensor([0, 299, 17, 17, 150], device="cuda")
    held = float(torch.tensor(25.298221281347036, dtype=dtype))
    want = embedding_quant(w, ids, held, dtype, backend="reference")
    got = embedding_quant(w, ids, held, dtype)
    assert got.is_cuda and got.dtype == dtype
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2.0 ** -7, atol=1e-6)
    else:
        largest = (w.scales.abs().max() * (2 ** bits - 1) + w.biases.abs().max()).item()
        assert (got - want).abs().max().item() <= 2.0 ** -22 * largest * held
