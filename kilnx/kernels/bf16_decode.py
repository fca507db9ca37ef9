"""4-bit affine codes decoded straight into bf16 tensor-core operands, two elements per instruction.

Why: the GEMMs that dequantize inside their K loop (`qmatmul.qmm`, and the MoE grouped GEMMs after it)
decode each code with a shift, a mask, an int -> float conversion, an FMA and a rounding to bf16: ~312
sm_90 SASS instructions per 32 codes a thread in qmm's loop at 128 x 128 x 64 (8 warps), in the same
warps that feed the tensor cores. Here a code pair costs one byte permute, one mask and two bf16x2 FMAs:
191 instructions for the same loop (bench/probes/sass_count.py). On the H200 that loop took gate_up at 128
and 512 rows in 99 / 354 us against 131 / 449 (bench/results/2026-12-04_h200_quant_s15_qmm*.csv).

Code pair p of a word (elements 2p and 2p + 1: the low and high nibble of byte p, MLX order) comes from
`prmt(w, w >> 4)` with byte p of w in byte 0 and byte p of w >> 4 in byte 2, masked to 0x000F000F and
OR-ed into bf16 128.0 (0x4300) in each half: (128 + q, 128 + q'), exact. One FMA subtracts 128, exactly;
the next gives q * s + b with one rounding to bf16, the group's scale and bias in both halves. bf16's 7
mantissa bits are why the high nibble is brought down first (fp16's trick, 16 q' in place, does not fit).
"""

from __future__ import annotations

import kilnx.dsl as kd
from kilnx.dsl.ir import dtype_of

ONE_ONE, MINUS_128 = 0x3F803F80, 0xC300C300        # bf16 pairs (1, 1) and (-128, -128)


def serves(bits: int, x_dtype, scale_dtype) -> bool:
    """Whether the packed decode applies: 4-bit codes, bf16 activations, bf16 scales and biases (dtypes as
    a kernel's trace names them or as torch does: the defaults decide on tensors)."""
    return bits == 4 and dtype_of(x_dtype) == "bf16" and dtype_of(scale_dtype) == "bf16"


def bf16_pairs(v):
    """bf16 tile -> u32 tile holding the value in both halves."""
    return (v.f32().bitcast(kd.u32) >> 16) * 0x10001


def weight_tile(words, scales, biases):
    """(BLOCK_N, 8 KW) bf16 weights from (BLOCK_N, KW) 4-bit words and their (BLOCK_N, NG) bf16 scales and
    biases, NG = max(8 KW / GROUP, 1) consecutive groups (all of the chunk's words in one group when
    8 KW <= GROUP). Every pair is a tile in the words' own layout; kd.join assembles them along axes the
    GPU keeps within a thread (a 3-d tile over the pairs let Triton spread them over lanes: each word
    then decoded four times and each scale loaded per element, 716 SASS instructions a chunk against 312)."""
    BN, KW = words.shape
    NG = scales.shape[1]
    s2, b2 = bf16_pairs(scales), bf16_pairs(biases)
    if NG > 1:   # each word takes its group's pair: words w * WPG .. of group g
        WPG = KW // NG
        s2 = kd.reshape(kd.broadcast_to(s2[:, :, None], (BN, NG, WPG)), (BN, KW))
        b2 = kd.reshape(kd.broadcast_to(b2[:, :, None], (BN, NG, WPG)), (BN, KW))
    high = words >> 4

    def pair(p: int):
        t = kd.byte_perm(words, high, p * 0x1111 + 0x4400)
        q = kd.bf2_fma((t & 0x000F000F) | 0x43004300, ONE_ONE, MINUS_128)
        return kd.bf2_fma(q, s2, b2)

    p0, p1, p2, p3 = (pair(p) for p in range(4))
    quads = kd.reshape(kd.join(kd.join(p0, p2), kd.join(p1, p3)), (BN, KW, 4))    # pairs 0..3 of each word
    return kd.reshape(kd.join(kd.bf2_half(quads, 0), kd.bf2_half(quads, 1)), (BN, 8 * KW))
