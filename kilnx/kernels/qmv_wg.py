"""The 4-bit affine (group 64) product on Hopper's wgmma with the weight decoded straight into the tensor
cores' register operand: `qmm_wg`, 16 activation rows a program for the GEMV's sizes (2-16 rows), more for
larger M.

Why: qmv_h2 multiplies on the CUDA cores, so its cost grows with the rows (on the H200 1.85x / 3.42x its
one-row time at 4 / 8 rows, session 14). The tensor-core kernels tried before (qmv_tc, qmm PACKED) stored the
decoded weight tile to shared memory and read it back in the MMA's operand layout. Here nothing moves:
Triton keeps wgmma's A operand in registers when it comes from elementwise ops, one `join` and reshapes of a
loaded tile, so the weight is stored (`pack_operand`) in the order a warpgroup's 128 threads hold the
operand, 16 contiguous bytes a thread per (64 rows x 64 codes) block:
    byte e of a block: o = e % 16, lane = e // 16 % 32, warp = e // 512
    row = 16 warp + 8 (o % 2) + lane // 4, byte column c = lane % 4 + 4 (o // 2)
    the byte holds codes k = 2c (bits 0-3) and 2c + 1 (bits 4-7) of the block's group,
a 1-d load (16-byte vectors) regrouped by reshape / permute is the operand's layout, and `kd.nibbles`
dequantizes four bytes per instruction group into it (q * s + b rounded once to bf16, as MLX's dequantize).
A K step takes GPI consecutive groups (one contiguous load of the `flat` blocks): with one group a step the
first GPU run waited ~0.7 us a 2 KB step, a latency bound, not a bandwidth one.

Measured on the H200 (bench/results README, session 20; bench/probes/tc_qmm.py, the plain-Triton form): at
2-16 rows the time is flat in the rows (qkv 10.2 / 10.2 / 10.4 us at 1 / 4 / 16 rows; qmv_h2 7.2 / 13.1 /
82.5), faster than qmv_h2 from 4 rows on all four llama-3.1-8b projections, slower at one row (qmv_h2 keeps
it). From 2048 rows qmatmul's route (dequantize + cuBLAS) is faster (1.10-1.17x cuBLAS's time against the
probe's best 1.56-1.85x); at 128-512 rows which wins depends on the projection.

qmatmul's route (kernels/routing.py) takes it for WG_MIN_ROWS-16 rows (4 by default) of 4-bit group-64 weights
with bf16 activations, scales and biases where the weight is large (REPACK_MIN_BYTES: gate_up and down, not qkv
and o) and the device has room for the operand layout beside MLX's (the 4-bit weight's bytes twice, packed at the
weight's first such call outside a CUDA graph capture); otherwise kernels/wg_direct.py's `qmm_wg_direct`, the same
product read from MLX's layout (no copy; faster on qkv and o, slower on gate_up and down, session 21).
KILNX_WG=1 gives every weight the route takes the copy, KILNX_WG=direct none.
"""

from __future__ import annotations

import logging

import torch

import kilnx.dsl as kd
from kilnx.dsl.kernel import PerObjectMemo
from kilnx.kernels.qmatmul import affine_tolerance

log = logging.getLogger(__name__)

GS, ROWS, XROWS = 64, 64, 16     # group size; weight rows per program (wgmma's M); most x rows qmatmul sends here
BLOCK_BYTES = ROWS * GS // 2


# ----------------------------------------------------------------------------- the operand layout (host)
def codes_of(wq: torch.Tensor) -> torch.Tensor:
    """MLX 4-bit words (N, K/8), code j of word w at bits 4j -> (N, K) uint8 codes (int32 shifts: the mask
    drops the sign bits an arithmetic shift brings in)."""
    shifts = torch.arange(0, 32, 4, device=wq.device, dtype=torch.int32)
    return ((wq.view(torch.int32)[:, :, None] >> shifts) & 0xF).to(torch.uint8).reshape(wq.shape[0], -1)


def pack_operand(wq: torch.Tensor, wg: int = 1) -> torch.Tensor:
    """MLX 4-bit group-64 words (N, K/8) -> (N/(64 wg), K/64, 2048 wg) bytes in the operand order (module doc)
    of programs of `wg` warpgroups (warps 4..7 of a second one hold rows 64..127; the kernels here take wg=1,
    bench/probes/tc_gemv.py times both)."""
    if wq.dtype not in (torch.uint32, torch.int32) or wq.dim() != 2:
        raise ValueError(f"pack_operand takes MLX 4-bit words (N, K/8) uint32, got {tuple(wq.shape)} {wq.dtype}")
    q = codes_of(wq)
    n, k = q.shape
    rows = ROWS * wg
    if n % rows or k % GS:
        raise ValueError(f"pack_operand: N ({n}) and K ({k}) must be multiples of {rows} and {GS}")
    # row = 16 warp + 8 o0 + lane_hi; k = 64 g + 2 (4 o_hi + lane_lo) + h
    q = q.reshape(n // rows, 4 * wg, 2, 8, k // GS, 8, 4, 2)
    byte = q[..., 0] | (q[..., 1] << 4)                  # (P, warp, o0, lane_hi, G, o_hi, lane_lo)
    # in memory: warp, lane (= 4 lane_hi + lane_lo), o (= 2 o_hi + o0)
    return byte.permute(0, 4, 1, 3, 6, 5, 2).reshape(n // rows, k // GS, BLOCK_BYTES * wg).contiguous()


def unpack_operand(wb: torch.Tensor) -> torch.Tensor:
    """pack_operand's inverse, as (N, K) uint8 codes."""
    p, g, _ = wb.shape
    byte = wb.reshape(p, g, 4, 8, 4, 8, 2).permute(0, 2, 6, 3, 1, 5, 4)   # (P, warp, o0, lane_hi, G, o_hi, lane_lo)
    q = torch.stack([byte & 15, byte >> 4], dim=-1)
    return q.reshape(p * ROWS, g * GS)


def group_major(t: torch.Tensor, wg: int = 1) -> torch.Tensor:
    """Per-group scales or biases (N, G) -> (N/(64 wg), G, 64 wg): a program's values of a group contiguous."""
    n, g = t.shape
    return t.reshape(n // (ROWS * wg), ROWS * wg, g).transpose(1, 2).contiguous()


def dequantized(wb, s_g, b_g) -> torch.Tensor:
    """The packed weight's meaning: (N, K) fp32, q * s + b (wb as pack_operand made it, or `flat`)."""
    p, g, _ = s_g.shape
    q = unpack_operand(wb.reshape(p, g, -1)).float()
    s = s_g.transpose(1, 2).reshape(p * ROWS, g).float().repeat_interleave(GS, dim=1)
    b = b_g.transpose(1, 2).reshape(p * ROWS, g).float().repeat_interleave(GS, dim=1)
    return q * s + b


# ----------------------------------------------------------------------------- the kernel (any rows)
def dequantized_tile(byt, s_g, b_g, block, groups, rows):
    """The bf16 weight tile (R, 64 G) of code bytes `byt` (R, 32 G) in an operand order: q * s + b with the scales
    and biases (group_major's (N/64, K/64, 64)) of `groups` (G,) for rows `rows` (R,) of 64-row block `block`."""
    R, G = rows.shape[0], groups.shape[0]
    s = kd.load(s_g, block, groups[None, :], rows[:, None], check=False)
    b = kd.load(b_g, block, groups[None, :], rows[:, None], check=False)
    s = kd.reshape(kd.broadcast_to(s[:, :, None], (R, G, 32)), (R, G * 32))
    b = kd.reshape(kd.broadcast_to(b[:, :, None], (R, G, 32)), (R, G * 32))
    return kd.reshape(kd.nibbles(byt, s, b), (R, G * GS))


def _gemm_spec(x, wb, s_g, b_g, **_):
    w = dequantized(wb, s_g, b_g).to(x.dtype).float()          # rounded to bf16 once, as the kernel's operand
    return (x.float() @ w.t()).to(x.dtype)


def _gemm_default(x, wb, s_g, b_g, **_):
    """Up to 16 rows (the GEMV's sizes): 16 a program, 4 groups a K step where K/64 allows, K split until the
    grid has ~2.5 programs an SM, 3 stages: on the H200 (bench/results README, session 20) that shape was the
    best or within ~10% of it on llama-3.1-8b's four projections (one group a step waited ~0.7 us a 2 KB step;
    8 a step was slower than 4). Then split once more while a program would still walk 8 or more steps: gate_up
    (448 programs, 16 steps) at split 2 took 30.9 against 33.5 us on the H200 (session 20) and 30.8 against 38.0
    on an H100 (session 25, bench/probes/wg_occupancy.py) — ncu found these kernels latency-bound with ~3
    programs an SM. More rows: 128 a program, 64 where that leaves SMs without a program.
    Starting points; `kilnx tune` stores the measured best."""
    from kilnx.kernels.dense_mm import sm_count
    sms = sm_count(x)
    if x.shape[0] <= XROWS:
        gpi = min(4, _gemm_specialize(x, wb, s_g, b_g)["G_DIV"])
        split = next((sp for sp in (1, 2, 4) if wb.shape[0] * sp >= 2.5 * sms), 8)
        steps = s_g.shape[1] // gpi
        while split < 8 and steps // (2 * split) >= 8:
            split *= 2
        return {"BLOCK_M": XROWS, "GPI": gpi, "SPLIT_K": split, "num_stages": 3}
    return {"BLOCK_M": 128 if wb.shape[0] * -(-x.shape[0] // 128) >= sms else 64}


def _gemm_specialize(x, wb, s_g, b_g, *_):
    """G_DIV: the largest step of groups (up to 8) that divides the groups, so a step never runs past K."""
    return {"G_DIV": max(d for d in (1, 2, 4, 8) if s_g.shape[1] % d == 0)}


@kd.kernel(tune={"BLOCK_M": kd.choice(16, 64, 128, 256, default=128), "GPI": kd.choice(1, 2, 4, 8, default=1),
                 "SPLIT_K": kd.choice(1, 2, 4, 8, default=1), "num_stages": kd.choice(1, 2, 3, 4, default=3)},
           key=lambda x, wb, s_g, b_g, **_: {"M": x.shape[0], "N": wb.shape[0] * ROWS, "K": x.shape[1]},
           spec=_gemm_spec, default=_gemm_default, specialize=_gemm_specialize)
def qmm_wg(x, wb, s_g, b_g, *, G_DIV: kd.constexpr, BLOCK_M, GPI, SPLIT_K):
    """y (M, N) = x (M, K) @ W.T, W dequantized to x's dtype (bf16) in registers; wb is pack_operand's weight
    flattened to (N/64, K/64 * 2048) (`flat`), so GPI consecutive blocks are one contiguous load. GPI groups a
    K step (one dot of K = 64 GPI): the weight bytes a program has in flight. y in x's dtype, or fp32 when K
    is split over SPLIT_K programs (added across them)."""
    M, K = x.shape
    P, G, _ = s_g.shape
    if G_DIV % GPI:
        raise kd.DSLError(f"qmm_wg: GPI {GPI} groups a step must divide the {G_DIV}-multiple of groups (K/64)")
    pid, pm, pk = kd.grid(P, kd.cdiv(M, BLOCK_M), SPLIT_K)
    rows, r64, gi = pid * ROWS + kd.arange(0, ROWS), kd.arange(0, ROWS), kd.arange(0, GPI)
    mm, kk = pm * BLOCK_M + kd.arange(0, BLOCK_M), kd.arange(0, GS * GPI)
    steps = G // GPI
    per = kd.cdiv(steps, SPLIT_K)
    acc = kd.zeros((ROWS, BLOCK_M), kd.f32)
    for step in kd.range(pk * per, kd.minimum(pk * per + per, steps)):
        g0 = step * GPI
        raw = kd.load(wb, pid, g0 * BLOCK_BYTES + kd.arange(0, BLOCK_BYTES * GPI), check=False)
        # (group, warp, lane_hi, lane_lo, o_hi, o0) -> rows (warp, o0, lane_hi), columns (group, o_hi, lane_lo)
        byt = kd.reshape(kd.permute(kd.reshape(raw, (GPI, 4, 8, 4, 8, 2)), (1, 5, 2, 0, 4, 3)), (ROWS, GPI * 32))
        a = dequantized_tile(byt, s_g, b_g, pid, g0 + gi, r64)
        acc += kd.dot(a, kd.trans(kd.load(x, mm[:, None], g0 * GS + kk[None, :], check=(True, False))))
    if SPLIT_K == 1:
        out = kd.output((M, P * ROWS), x.dtype)
        kd.store(out, mm[None, :], rows[:, None], acc)
    else:
        out = kd.output((M, P * ROWS), kd.f32, zero=True)
        kd.atomic_add(out, mm[None, :], rows[:, None], acc)
    return out


def flat(wb: torch.Tensor) -> torch.Tensor:
    """pack_operand's (N/64, K/64, 2048) bytes as qmm_wg reads them: (N/64, K/64 * 2048), a view."""
    return wb.reshape(wb.shape[0], -1)


# ----------------------------------------------------------------------------- tuning inputs
def make_gemm_args(problem: dict, device: str):
    """qmm_wg's inputs for a problem {M, N, K}: qmatmul's random 4-bit weight in the operand layout."""
    from kilnx.kernels.qmatmul import make_qmatmul_args
    x, wq, scales, biases = make_qmatmul_args({**problem, "bits": 4, "gs": GS}, device)
    return x, flat(pack_operand(wq)), group_major(scales), group_major(biases)


def _dense(wb, s_g, b_g) -> torch.Tensor:
    """The bf16 weight the peer multiplies, kept for the last weight asked (the tuner times one at a time)."""
    cached = getattr(_dense, "cache", None)
    if cached is None or cached[0] is not wb or cached[1] is not s_g:
        _dense.cache = cached = (wb, s_g, dequantized(wb, s_g, b_g).to(torch.bfloat16))
    return cached[2]


qmm_wg.tuning(make_args=make_gemm_args, peer=lambda x, wb, s_g, b_g: x @ _dense(wb, s_g, b_g).t(),
              problems=[{"M": m, "N": 4096, "K": 4096} for m in (4, 16, 128)])
qmm_wg.tolerance = lambda args: affine_tolerance(args[0], *args[2:], 4)


# ----------------------------------------------------------------------------- the route's use (kernels/routing.py)
# Weights of at least this many packed bytes get the repacked copy where memory allows (the route's default for
# `WG_REPACKED`): at 4 rows on the H200 the repacked kernel took 30.9 / 18.4 us on llama-3.1-8b's gate_up (58.7 MB) /
# down (29.4 MB) against qmm_wg_direct's 42.2 / 25.1, and lost on qkv (12.6 MB) / o (8.4 MB): 11.3 / 9.0 against
# 10.3 / 9.2 (sessions 20-21); an H100 agreed (gate_up 30.8 against the route's 42.8 us, session 25)
REPACK_MIN_BYTES = 16 << 20
# Memory a copy must leave free on the device (of its total): the KV cache and activations were sized before the
# first batched call packs, so a copy may only take what nothing else was given
RESERVE_FRACTION, RESERVE_MIN_BYTES = 0.05, 1 << 30

_OPERANDS = PerObjectMemo(None, generational=False)
"""packed words -> operand: each weight's repacked copy, made once, dropped with it."""


def repack_pays(wq: torch.Tensor) -> bool:
    """Whether the route's default gives this weight the repacked copy (REPACK_MIN_BYTES)."""
    return wq.numel() * wq.element_size() >= REPACK_MIN_BYTES


def memory_allows(wq: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor) -> bool:
    """Whether a copy of (wq, scales, biases), with the packing's transient (codes as int32 and uint8, ~10x the
    words), leaves RESERVE of the device's memory free. Memory torch's allocator holds unused counts as free."""
    if not wq.is_cuda:
        return True
    free, total = torch.cuda.mem_get_info(wq.device)
    free += torch.cuda.memory_reserved(wq.device) - torch.cuda.memory_allocated(wq.device)
    words = wq.numel() * wq.element_size()
    need = 11 * words + scales.numel() * scales.element_size() + biases.numel() * biases.element_size()
    return free - need >= max(RESERVE_MIN_BYTES, RESERVE_FRACTION * total)


def operand_for(wq: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor):
    """(bytes, scales, biases) of the weight in the operand layout, made at its first call and kept while wq
    lives; None inside a CUDA graph capture before that (packing there would be replayed with every step) or
    where memory_allows says no (the caller serves from MLX's layout instead)."""
    hit = _OPERANDS.get((wq,), "operand")
    if hit is not PerObjectMemo.MISSING:
        return hit
    if wq.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if not memory_allows(wq, scales, biases):
        log.info("qmm_wg: no room for a repacked copy of a %s weight; qmm_wg_direct serves it", tuple(wq.shape))
        return None
    return _OPERANDS.put((wq,), "operand", (flat(pack_operand(wq)), group_major(scales), group_major(biases)))


def server_of(op, backend: str | None = None):
    """The qmatmul call (x, wq, scales, biases) -> y in x's dtype through qmm_wg on the operand `op` (split K
    adds in fp32, hence the cast)."""
    return lambda x2, *_: qmm_wg(x2, *op, backend=backend).to(x2.dtype)
