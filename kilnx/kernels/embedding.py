"""Embedding lookup as a kernel: out[t] = table[ids[t]], from a dense table or a quantized one.

Why a kernel for a gather: every piece of a decode step that writes data is then a kernel launch, so
the CPU engine can record a step's launches once and replay them (kilnx/runtime/engine.py); a torch
gather in the middle of the step would not be replayed.

Why a quantized table: a dense copy of a quantized checkpoint's embedding costs more memory than the
codes (Gemma-3-270M: 671 MB of fp32 for a 262k x 640 table whose 8-bit codes, with their fp32 scales and
biases, take 210 MB), and making it dominated loading; where the lm_head is the same tensor (tied
embeddings) the lookup reads the lm_head's own codes (models/weights.py QuantEmbedding).
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd


def _spec(table, ids, **_):
    return table[ids.long()]


@kd.kernel(tune={"BLOCK": kd.pow2(64, 4096, default=1024), "num_warps": kd.choice(1, 2, 4, default=4)},
           key=lambda table, ids, **_: {"T": ids.shape[0], "H": table.shape[1]}, spec=_spec)
def embedding_kernel(table, ids, *, BLOCK):
    V, H = table.shape
    T = ids.shape[0]
    t, pb = kd.grid(T, kd.cdiv(H, BLOCK))
    cols = pb * BLOCK + kd.arange(0, BLOCK)
    row = kd.load(ids, t, check=False)
    out = kd.output((T, H), table.dtype)
    kd.store(out, t, cols, kd.load(table, row, cols, check=(False, True)))
    return out


def embedding(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return embedding_kernel(table, ids.reshape(-1))


def dequantized_rows(packed, scales, biases, ids, bits: int, group: int, scale: float, dtype: torch.dtype):
    """The lookup's meaning in torch: rows ids of the dequantized table (q * s + b in fp32), rounded to dtype,
    times `scale` in dtype."""
    from kilnx.kernels.qmatmul import dequantize_on_device
    rows = ids.reshape(-1).long()
    w = dequantize_on_device(packed[rows], scales[rows], biases[rows], bits, group).to(dtype)
    return w if scale == 1.0 else w * torch.tensor(scale, dtype=dtype)


def _q_spec(packed, scales, biases, ids, *, scale, BITS, GROUP, OUT, **_):
    from kilnx.dsl.ir import torch_dtype
    return dequantized_rows(packed, scales, biases, ids, BITS, GROUP, scale, torch_dtype(OUT))


@kd.kernel(tune={"BLOCK_W": kd.pow2(8, 512, default=64), "num_warps": kd.choice(1, 2, 4, default=2)},
           key=lambda packed, scales, biases, ids, **_: {"T": ids.shape[0], "KW": packed.shape[1],
                                                         "G": scales.shape[1]},
           spec=_q_spec)
def embedding_q_kernel(packed, scales, biases, ids, *, scale: float, BITS: kd.constexpr, GROUP: kd.constexpr,
                       OUT: kd.constexpr, BLOCK_W):
    """Rows of an affine (V, H) table of BITS-bit codes (whole codes per uint32 word, LSB first, groups of
    GROUP along H): out[t] = (q * s + b) rounded to OUT, times `scale` (already an OUT value) in OUT."""
    V, KW = packed.shape
    T = ids.shape[0]
    PER = 32 // BITS
    BW = max(BLOCK_W, GROUP // PER)
    t, pw = kd.grid(T, kd.cdiv(KW, BW))
    row = kd.load(ids, t, check=False)
    w = pw * BW + kd.arange(0, BW)
    words = kd.load(packed, row, w, check=(False, True))
    q = ((words[:, None] >> (kd.arange(0, PER) * BITS)[None, :]) & ((1 << BITS) - 1)).f32()   # (BW, PER)
    g = (w * PER) // GROUP                   # a word's codes share its group (GROUP is a multiple of PER)
    s = kd.load(scales, row, g, check=(False, True)).f32()
    b = kd.load(biases, row, g, check=(False, True)).f32()
    v = q * s[:, None] + b[:, None]
    v = v.astype(OUT).f32() * scale          # as the dense table was made: rounded, then scaled (x 1.0: exact)
    out = kd.output((T, KW * PER), OUT)
    kd.store(out, t, w[:, None] * PER + kd.arange(0, PER)[None, :], v)
    return out


def embedding_quant(weight, ids: torch.Tensor, scale: float, dtype: torch.dtype, *, backend=None) -> torch.Tensor:
    """Rows ids (any shape, flattened) of the affine QWeight `weight` (V, H) times `scale` (a value dtype
    holds: rounded once by the caller, not per lookup, which would be a torch op and a host read in every
    step), in dtype."""
    from kilnx.dsl.ir import dtype_of
    return embedding_q_kernel(weight.packed, weight.scales, weight.biases, ids.reshape(-1), scale=scale,
                              BITS=weight.bits, GROUP=weight.group_size, OUT=dtype_of(dtype), backend=backend)


def _args(problem: dict, device: str):
    table = torch.randn(1000, problem["H"]).to(device)
    return table, torch.randint(0, 1000, (problem["T"],)).to(device)


embedding_kernel.tuning(make_args=_args, problems=[{"T": 1, "H": 4096}])

