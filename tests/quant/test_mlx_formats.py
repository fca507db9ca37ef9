"""The numpy references against MLX itself (mlx-cpu): same packed words, same scales, same
dequantized values, for every mode, bit width, group size and input dtype."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.quant import mlx_formats as mf
from kilnx.quant.bitpack import pack_bits, unpack_bits
from kilnx.quant.float_codecs import e4m3_decode, e4m3_encode, round_to

mx = pytest.importorskip("mlx.core")

MX_DTYPE = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DTYPES = tuple(MX_DTYPE)


def as_f32(a) -> np.ndarray:
    return np.array(a.astype(mx.float32)) if a.dtype in (mx.bfloat16, mx.float16) else np.array(a)


def random_weights(rng, n, k, dtype):
    """Rows at very different magnitudes, so scales span many exponents."""
    w = rng.standard_normal((n, k)) * rng.choice([1e-3, 0.05, 1.0, 40.0], size=(n, 1))
    wm = mx.array(w.astype(np.float32)).astype(MX_DTYPE[dtype])
    return wm, as_f32(wm)


def check_affine_against_mlx(wm, w, bits, group_size, dtype):
    p, s, b = mx.quantize(wm, group_size, bits)
    packed, scales, biases = mf.affine_quantize(w, group_size, bits, dtype=dtype)
    np.testing.assert_array_equal(packed, np.array(p))
    np.testing.assert_array_equal(scales, as_f32(s))
    np.testing.assert_array_equal(biases, as_f32(b))
    ours = mf.affine_dequantize(packed, scales, biases, group_size, bits, dtype=dtype)
    np.testing.assert_array_equal(ours, as_f32(mx.dequantize(p, s, b, group_size, bits)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", mf.AFFINE_GROUP_SIZES)
@pytest.mark.parametrize("bits", mf.AFFINE_BITS)
def test_affine_bit_exact_with_mlx(bits, group_size, dtype):
    rng = np.random.default_rng(bits * 1000 + group_size)
    wm, w = random_weights(rng, 8, 256, dtype)
    check_affine_against_mlx(wm, w, bits, group_size, dtype)


@pytest.mark.parametrize("bits", mf.AFFINE_BITS)
def test_affine_edge_groups_match_mlx(bits):
    """Constant, all-zero, one-sided and max-is-edge groups take the special branches."""
    w = np.zeros((4, 64), np.float32)
    w[0] = 3.0                      # constant: q0 != 0, scale = edge / q0
    w[1] = 0.0                      # all zero: scale = -eps, bias 0
    w[2] = np.linspace(0.1, 5, 64)  # positive only: max is the edge, negative scale
    w[3] = -np.linspace(0.1, 5, 64)  # negative only: min is the edge
    check_affine_against_mlx(mx.array(w), w, bits, 32, "float32")


FP_CASES = [("mxfp4", None), ("mxfp8", None), ("nvfp4", None), ("nvfp4", 7.5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,global_scale", FP_CASES)
def test_fp_modes_bit_exact_with_mlx(mode, global_scale, dtype):
    rng = np.random.default_rng(len(mode) + int(global_scale or 0) * 10)
    wm, w = random_weights(rng, 16, 256, dtype)
    w[0, :32] = 0.0  # an all-zero group
    wm = mx.array(w).astype(MX_DTYPE[dtype])
    kw = {} if global_scale is None else {"global_scale": mx.array(np.float32(global_scale))}
    p, s = mx.quantize(wm, mode=mode, **kw)[:2]
    packed, codes = mf.fp_quantize(w, mode, dtype=dtype, global_scale=global_scale)
    np.testing.assert_array_equal(packed, np.array(p))
    np.testing.assert_array_equal(codes, np.array(s))
    for out_dtype in DTYPES:
        theirs = as_f32(mx.dequantize(p, s, mode=mode, dtype=MX_DTYPE[out_dtype], **kw))
        ours = mf.fp_dequantize(packed, codes, mode, dtype=out_dtype, global_scale=global_scale)
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8"])
def test_fp_extreme_magnitudes_match_mlx(mode):
    """Groups whose e8m0 exponent leaves [-127, 127] (the code wraps) and huge groups."""
    w = np.zeros((4, 32), np.float32)
    w[0, 0], w[1, 0], w[2, 0], w[3, :] = 1e-41, 3e38, 1e-38, -1e-20
    p, s = mx.quantize(mx.array(w), mode=mode)[:2]
    packed, codes = mf.fp_quantize(w, mode, dtype="float32")
    np.testing.assert_array_equal(packed, np.array(p))
    np.testing.assert_array_equal(codes, np.array(s))


def test_e2m1_ties_go_to_the_smaller_magnitude():
    # MLX takes the first minimum of |x - lut|: 0.75 -> 0.5 and 2.5 -> 2, not round-half-even.
    w = np.zeros((1, 32), np.float32)
    w[0, :4] = [6.0, 0.75, 2.5, -2.5]
    packed, codes = mf.fp_quantize(w, "mxfp4", dtype="float32")
    assert codes[0, 0] == 127  # amax 6 -> scale 1
    vals = mf.fp_dequantize(packed, codes, "mxfp4")[0, :4]
    np.testing.assert_array_equal(vals, [6.0, 0.5, 2.0, -2.0])
    p, s = mx.quantize(mx.array(w), mode="mxfp4")[:2]
    np.testing.assert_array_equal(packed, np.array(p))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 64),
    groups=st.integers(1, 4),
    bits=st.sampled_from(mf.AFFINE_BITS),
    group_size=st.sampled_from(mf.AFFINE_GROUP_SIZES),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31),
)
def test_affine_any_shape_matches_mlx(n, groups, bits, group_size, dtype, seed):
    k = min(groups * group_size, 512)
    wm, w = random_weights(np.random.default_rng(seed), n, k, dtype)
    check_affine_against_mlx(wm, w, bits, group_size, dtype)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 64),
    groups=st.integers(1, 16),
    mode=st.sampled_from(tuple(mf.FP_MODES)),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31),
)
def test_fp_any_shape_matches_mlx(n, groups, mode, dtype, seed):
    # K a multiple of 32 for every mode: MLX's own nvfp4 fallback cannot pack fewer than 32 values.
    k = groups * 32
    wm, w = random_weights(np.random.default_rng(seed), n, k, dtype)
    p, s = mx.quantize(wm, mode=mode)[:2]
    packed, codes = mf.fp_quantize(w, mode, dtype=dtype)
    np.testing.assert_array_equal(packed, np.array(p))
    np.testing.assert_array_equal(codes, np.array(s))
    theirs = as_f32(mx.dequantize(p, s, mode=mode, dtype=MX_DTYPE[dtype]))
    np.testing.assert_array_equal(mf.fp_dequantize(packed, codes, mode, dtype=dtype), theirs)


# ----------------------------------------------------------------------------- building blocks


def test_pack_4bit_layout_is_lsb_first():
    codes = np.arange(8, dtype=np.uint8)[None]  # element i = i
    word = pack_bits(codes, 4)[0, 0]
    assert word == 0x76543210  # byte 0 = element 1 << 4 | element 0


@given(bits=st.sampled_from((2, 4, 8)), rows=st.integers(1, 3), words=st.integers(1, 4), seed=st.integers(0, 99))
@settings(max_examples=30, deadline=None)
def test_pack_bits_is_the_lsb_first_bit_stream(bits, rows, words, seed):
    """Code i of a row is bits [i*b, (i+1)*b) of the row's stream, bit t of the stream bit t % 32 of word
    t // 32 (the widths that fill bytes take a byte-wise path: checked here against the stream itself)."""
    k = words * 32 // bits
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=(rows, k))
    want = [[sum(int(c) << (i * bits) for i, c in enumerate(row)) >> (32 * w) & 0xFFFFFFFF for w in range(words)]
            for row in codes]
    assert pack_bits(codes, bits).tolist() == want


def test_pack_3bit_values_straddle_words():
    codes = np.zeros((1, 32), np.uint8)
    codes[0, 10] = 0b111  # bits 30, 31 of word 0 and bit 0 of word 1
    words = pack_bits(codes, 3)[0]
    assert words.tolist() == [0xC0000000, 0x1, 0x0]


@pytest.mark.parametrize("bits", (2, 3, 4, 5, 6, 8))
def test_pack_unpack_round_trip(bits):
    codes = np.random.default_rng(bits).integers(0, 2**bits, size=(3, 2, 64)).astype(np.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, 2, 64 * bits // 32) and packed.dtype == np.uint32
    np.testing.assert_array_equal(unpack_bits(packed, bits), codes)


def test_pack_rejects_unsupported_width():
    with pytest.raises(ValueError, match="7-bit"):
        pack_bits(np.zeros((1, 32), np.uint8), 7)


def test_round_to_bf16_matches_torch():
    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 1e3
    x[:3] = [1.00390625, 1.01171875, -3.0e38]  # exact ties (to even) and a large value
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(round_to(x, "bfloat16"), want)


def test_e4m3_encode_matches_torch_in_range_and_saturates():
    x = np.random.default_rng(1).standard_normal(10000).astype(np.float32) * np.float32(50)
    x = np.clip(x, -448, 448)
    x[:4] = [2.0**-10, 3 * 2.0**-10, 0.0, -0.0]  # subnormal ties
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(e4m3_encode(x), want)
    assert e4m3_encode(np.array([500.0, -1e9], np.float32)).tolist() == [0x7E, 0xFE]
    np.testing.assert_array_equal(e4m3_decode(e4m3_encode(x)), torch.from_numpy(x).to(torch.float8_e4m3fn).float().numpy())
