"""Mixture-of-experts matmuls over MLX-affine 2/4/8-bit expert stacks W (E, N, K), in the DSL.

Every (token, slot) pair i = t * top_k + k multiplies a row of x by the weight of expert
expert_ids[t, k]. Two layouts of that work:

- Grouped GEMM (`gather_qmm*`, any number of tokens): the align step groups the slots by expert into
  blocks of BLOCK_M rows of one expert. A program takes one such block and BLOCK_N output columns,
  dequantizes the expert's weight tile in registers (whole packed words along K expanded by a
  broadcast shift, scale and bias per group, as qmm does) and multiplies with kd.dot. Blocks past the
  last expert's run do no K iterations at all.
- Per-slot GEMV (`gather_qmv*`, decode): one program per (token, BLOCK_N output rows) holding all of
  the token's top_k slots: tile row r is (slot r // BLOCK_N, row r % BLOCK_N), so every slot's expert
  weights stream in the same pass (no serial loop over slots) and a per-token x is loaded once for
  all of them. Packed words are loaded whole along K, the codes of each word position unrolled, scale
  and bias applied once per group to partial sums (as qmv does). No align step, no padding. (H200,
  qwen3-30b-a3b at one token: a program per slot, and a serial loop over the slots in the combine,
  took 15 + 18 us.)

Epilogues, each its own kernel so that the tuner can time and key them apart:
  *_glu      SwiGLU / GeGLU on a [gate | up] weight (N = 2F): act(x W_gate^T) * (x W_up^T), (.., F).
  gather_qmm with float `routing` (routing weights, not ids): each row scaled by its weight.
  *_combine  weighted by the routing weights and summed over the top_k slots into (T, N).

Rows of x are tokens (x (T, K), shared by a token's slots) or slots (x (T * top_k, K), e.g. the
activations feeding the down projection); which one follows from x's row count. Compile-time
parameters all follow from the arguments' shapes, so the tuner can build any kernel from its inputs.
The fused decode MoE (`moe` for T <= MOE_DECODE_MAX_TOKENS) is two launches: gather_qmv_glu for
gate_up + activation per (token, slot), then gather_qmv_combine for down + the weighted sum.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd
from kilnx.kernels import bf16_decode
from kilnx.kernels.moe_align import align, align_block_m, align_buffers
from kilnx.kernels.sizes import pow2_at_least, pow2_dividing

ACTIVATIONS = {"silu": kd.silu, "gelu_tanh": kd.gelu_tanh}
# activations of experts without a gate (nemotron-3's relu²): w_gate_up holds the up projection alone (E, F, H)
UNGATED = {"relu2": lambda u: kd.maximum(u, 0.0) * kd.maximum(u, 0.0)}
# decode/prefill crossovers (tokens); later the tuner will store measured ones
GATHER_QMV_MAX_TOKENS = 4
MOE_DECODE_MAX_TOKENS = 4


# ---- traced building blocks -----------------------------------------------------------------------
def _code_f32(code, MAGIC):
    """Small non-negative int codes as exact fp32. With MAGIC no int->float conversion (a quarter-rate
    instruction on sm_90): OR-ed into the mantissa of 2^23 the code is 2^23 + code exactly."""
    return (code | 0x4B000000).bitcast(kd.f32) - 8388608.0 if MAGIC else code.f32()


def _dequantized_tile_t(wq, scales, biases, expert, cols, k0, BITS, GROUP, BLOCK_K, MAGIC, check,
                        packed=False):
    """W[expert][cols, k0:k0 + BLOCK_K] dequantized and transposed: (BLOCK_K, len(cols)) fp32 (bf16 when
    `packed`: 4-bit codes decoded two per instruction, kernels/bf16_decode.py). Code j of packed word w
    is element k = w * PER + j (LSB first). `check`: bounds checks on the (row, K) dims; the expert of a
    block that runs exists."""
    PER = 32 // BITS
    BN = cols.shape[0]
    NG = max(BLOCK_K // GROUP, 1)    # quantization groups per K step
    chk = (False, *check)
    if packed:
        g = (k0 // GROUP + kd.arange(0, NG))[None, :]
        return kd.trans(bf16_decode.weight_tile(
            kd.load(wq, expert, cols[:, None], (k0 // 8 + kd.arange(0, BLOCK_K // 8))[None, :], check=chk),
            kd.load(scales, expert, cols[:, None], g, check=chk), kd.load(biases, expert, cols[:, None], g, check=chk)))
    words = kd.load(wq, expert, cols[:, None], (k0 // PER + kd.arange(0, BLOCK_K // PER))[None, :], check=chk)
    shifts = kd.arange(0, PER) * BITS
    q = _code_f32(kd.reshape((words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1), (BN, BLOCK_K)),
                  MAGIC)
    # one scale and bias per row and group, broadcast over the group's codes
    g = (k0 // GROUP + kd.arange(0, NG))[None, :]
    s = kd.load(scales, expert, cols[:, None], g, check=chk).f32()
    b = kd.load(biases, expert, cols[:, None], g, check=chk).f32()
    if BLOCK_K > GROUP:
        w = kd.reshape(kd.reshape(q, (BN, NG, GROUP)) * s[:, :, None] + b[:, :, None], (BN, BLOCK_K))
    else:
        w = q * s + b
    return kd.trans(w)


def _epilogue(act, acc, acc_up):
    """A product's activation: act(gate) * up for a GLU (acc the gate half), act(acc) for an ungated one
    (nemotron-3's relu²), acc itself for none."""
    if act in ACTIVATIONS:
        return ACTIVATIONS[act](acc) * acc_up
    return UNGATED[act](acc) if act else acc


def _gather_gemm(x, wq, scales, biases, sorted_ids, block_expert, routing, *, act, combine, BITS, GROUP,
                 BLOCK_M, X_BY_TOKEN, DIVS, BLOCK_N, BLOCK_K, MAGIC, PACKED=False):
    K = x.shape[1]
    packed = PACKED and bf16_decode.serves(BITS, x.dtype, scales.dtype)
    T, TOP_K = routing.shape
    numel = T * TOP_K
    glu = act in ACTIVATIONS       # else `act` is None or an ungated activation of the product itself
    n_out = wq.shape[1] // 2 if glu else wq.shape[1]
    # no bounds masks along N or K where the blocks divide them (the compiler can then vectorize)
    check = (DIVS[0] % BLOCK_N != 0, DIVS[1] % BLOCK_K != 0)
    pid_m, pid_n = kd.grid(block_expert.shape[0], kd.cdiv(n_out, BLOCK_N))
    slot = kd.load(sorted_ids, pid_m * BLOCK_M + kd.arange(0, BLOCK_M))   # numel marks padding
    expert = kd.load(block_expert, pid_m)
    # the sentinel slot maps past the last row of x and of the output: bounds checks mask it
    x_row = slot // TOP_K if X_BY_TOKEN else slot
    cols = pid_n * BLOCK_N + kd.arange(0, BLOCK_N)
    k_stop = kd.where(expert >= 0, K, 0)    # a block past the last run (expert -1) does nothing
    acc = kd.zeros((BLOCK_M, BLOCK_N), kd.f32)
    acc_up = kd.zeros((BLOCK_M, BLOCK_N), kd.f32) if glu else None
    for k0 in kd.range(0, k_stop, BLOCK_K):
        a = kd.load(x, x_row[:, None], (k0 + kd.arange(0, BLOCK_K))[None, :], check=(True, check[1]))
        w = _dequantized_tile_t(wq, scales, biases, expert, cols, k0, BITS, GROUP, BLOCK_K, MAGIC, check, packed)
        acc += kd.dot(a, w.to(x.dtype))
        if glu:
            # the up half shares the activations tile: one x load feeds both products
            w_up = _dequantized_tile_t(wq, scales, biases, expert, cols + n_out, k0, BITS, GROUP, BLOCK_K,
                                       MAGIC, check, packed)
            acc_up += kd.dot(a, w_up.to(x.dtype))
    y = _epilogue(act, acc, acc_up)
    if routing.dtype in (kd.f16, kd.bf16, kd.f32, kd.f64):
        y = y * kd.load(routing, slot // TOP_K, slot % TOP_K).f32()[:, None]
    if combine:
        out = kd.output((T, n_out), kd.f32, zero=True)
        kd.atomic_add(out, (slot // TOP_K)[:, None], cols[None, :], y, check=(True, check[0]))
    else:
        out = kd.output((numel, n_out), x.dtype)
        kd.store(out, slot[:, None], cols[None, :], y, check=(True, check[0]))
    return out


def _slot_rows_dot(x, x_row, wq, scales, biases, expert, row_tiles, valid, BITS, GROUP, BLOCK_KW, MAGIC, check,
                   STAGES=1):
    """For each tile row r and each tile of weight rows: sum_k W[expert[r]][rows[r], k] * x[x_row[r], k],
    fp32 (R,) tiles, over rows where `valid`. One pass over K serves every row tile; code j of every
    packed word is consumed as soon as x's plane j arrives, so few tiles are live at once.
    sum_k w_k x_k = sum_g s_g sum_{k in g} q_k x_k + b_g sum_{k in g} x_k (scale, bias once per group).
    `check`: bounds checks on the (row, K) dims; experts and x rows of valid rows exist. STAGES > 1
    pipelines the chunk loop's loads (kd.range stages; see _gemv.Frame)."""
    PER = 32 // BITS
    WPG = GROUP // PER               # words per group
    G = max(BLOCK_KW // WPG, 1)      # whole groups per chunk
    CHUNK = G * WPG
    MASK = (1 << BITS) - 1
    R = row_tiles[0].shape[0]
    chk = (False, *check)
    live = valid[:, None]
    accs = [kd.zeros((R,), kd.f32) for _ in row_tiles]
    for w0 in kd.range(0, wq.shape[2], CHUNK, stages=STAGES if STAGES > 1 else None):
        word = w0 + kd.arange(0, CHUNK)[None, :] + kd.full((R, 1), 0, kd.i32)
        words = [kd.load(wq, expert[:, None], rows[:, None], word, mask=live, hint="stream", check=chk)
                 for rows in row_tiles]
        qx = [None] * len(row_tiles)
        x_all = None
        for j in kd.static_range(PER):
            # x as an (R, CHUNK) tile: it arrives in the packed words' register layout (a 1-d tile
            # would be re-laid out for every code position); rows of one token share addresses
            xj = kd.load(x, x_row, word * PER + j, mask=live, check=(False, check[1])).f32()
            x_all = xj if x_all is None else x_all + xj
            for t in range(len(row_tiles)):
                term = _code_f32((words[t] >> (j * BITS)) & MASK, MAGIC) * xj
                qx[t] = term if qx[t] is None else qx[t] + term
        x_group = kd.reshape(kd.sum(kd.reshape(x_all, (R * G, WPG)), axis=1), (R, G))
        group = (w0 // WPG + kd.arange(0, G))[None, :]
        for acc, rows, q in zip(accs, row_tiles, qx):
            s = kd.load(scales, expert[:, None], rows[:, None], group, mask=live, check=chk).f32()
            b = kd.load(biases, expert[:, None], rows[:, None], group, mask=live, check=chk).f32()
            q_group = kd.reshape(kd.sum(kd.reshape(q, (R * G, WPG)), axis=1), (R, G))
            acc += kd.sum(q_group * s + b * x_group, axis=1)
    return accs


def _gemv_checks(DIVS, BITS, GROUP, BLOCK_N, BLOCK_KW):
    """Bounds checks needed on the (row, K) dims: none where the blocks divide the sizes."""
    WPG = GROUP * BITS // 32
    return DIVS[0] % BLOCK_N != 0, (DIVS[1] * BITS // 32) % (max(BLOCK_KW // WPG, 1) * WPG) != 0


def _gather_gemv(x, wq, scales, biases, expert_ids, routing_weights, *, act, BITS, GROUP, X_BY_TOKEN, DIVS, SLOTS,
                 BLOCK_N, BLOCK_KW, MAGIC, STAGES=1):
    """A program: one token, BLOCK_N output rows, all its top_k slots at once. Tile row r is slot
    r // BLOCK_N and output row r % BLOCK_N: every slot's expert is read in the same pass (no serial
    loop over slots), and when x is per token all rows share its loads."""
    T, TOP_K = expert_ids.shape
    glu = act in ACTIVATIONS
    n_out = wq.shape[1] // 2 if glu else wq.shape[1]
    check = _gemv_checks(DIVS, BITS, GROUP, BLOCK_N, BLOCK_KW)
    token, pid_n = kd.grid(T, kd.cdiv(n_out, BLOCK_N))
    r = kd.arange(0, SLOTS * BLOCK_N)
    k = r // BLOCK_N
    n = pid_n * BLOCK_N + r % BLOCK_N
    valid = k < TOP_K
    expert = kd.load(expert_ids, token, k)
    x_row = token if X_BY_TOKEN else (token * TOP_K + k)[:, None]
    tiles = [n, n + n_out] if glu else [n]
    accs = _slot_rows_dot(x, x_row, wq, scales, biases, expert, tiles, valid, BITS, GROUP, BLOCK_KW, MAGIC, check,
                          STAGES)
    y = _epilogue(act, accs[0], accs[1] if glu else None)
    if routing_weights is None:
        out = kd.output((T * TOP_K, n_out), x.dtype)
        kd.store(out, token * TOP_K + k, n, y, mask=valid, check=(False, check[0]))
    else:
        # weighted, then summed over the slots: rows (slot, n) -> (n,)
        y = y * kd.load(routing_weights, token, k).f32()
        out = kd.output((T, n_out), x.dtype)
        kd.store(out, token, pid_n * BLOCK_N + kd.arange(0, BLOCK_N), kd.sum(kd.reshape(y, (SLOTS, BLOCK_N)), axis=0),
                 check=(False, check[0]))
    return out


# ---- kernels ------------------------------------------------------------------------------------
def _format(x, wq, scales):
    """Bit width and group size from the shapes: K*bits/32 words and K/group scales per row."""
    k = x.shape[1]
    return {"BITS": wq.shape[2] * 32 // k, "GROUP": k // scales.shape[2]}


def _divs(x, wq):
    """Powers of two dividing N and K: blocks they divide need no masks. For N, the one dividing N / 2
    when N is even: it divides N too, so a GLU kernel (blocks over one half) and a plain one share it."""
    return pow2_dividing(wq.shape[1] // 2 if wq.shape[1] % 2 == 0 else wq.shape[1]), pow2_dividing(x.shape[1])


def _gemm_specialize(x, wq, scales, biases, sorted_ids, block_expert, routing):
    return {**_format(x, wq, scales), "BLOCK_M": sorted_ids.shape[0] // block_expert.shape[0],
            "X_BY_TOKEN": x.shape[0] != routing.numel(), "DIVS": _divs(x, wq)}


def _gemv_specialize(x, wq, scales, biases, expert_ids, routing_weights=None):
    return {**_format(x, wq, scales), "X_BY_TOKEN": x.shape[0] != expert_ids.numel(), "DIVS": _divs(x, wq),
            "SLOTS": pow2_at_least(expert_ids.shape[1])}


def _gemm_default(x, wq, scales, biases, sorted_ids, block_expert, routing, *, BLOCK_M, BITS, **_):
    if x.is_cuda and bf16_decode.serves(BITS, x.dtype, scales.dtype):
        # codes decoded in bf16 pairs: qwen3-30b-a3b, 2048 tokens (64-row blocks), H200: gate_up 460 us and
        # down 336 against 764 / 458 on the fp32 decode's default (bench/results, session 15)
        return {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, "PACKED": True}
    return {"BLOCK_N": 128 if BLOCK_M >= 64 else 64, "BLOCK_K": 64, "num_warps": 8 if BLOCK_M >= 64 else 4}


def _gemv_default(x, wq, scales, biases, expert_ids, *rest, SLOTS, **_):
    # about 8 rows x 128 words per program, as qmv's measured default (a program's rows are its
    # token's SLOTS slots times BLOCK_N); a short row (the down projection's K = F is often < 1024)
    # is one chunk. On the CPU backends a program costs far more than its arithmetic: wider ones.
    return {"BLOCK_KW": min(max(pow2_at_least(wq.shape[2]), 8), 128),
            "BLOCK_N": max(8 // SLOTS, 1) if x.is_cuda else 16}


GEMM_TUNE = {"BLOCK_N": kd.pow2(16, 256, default=64), "BLOCK_K": kd.pow2(32, 256, default=64),
             "MAGIC": kd.boolean(default=True), "PACKED": kd.boolean(default=False),
             "num_warps": kd.choice(2, 4, 8, default=4), "num_stages": kd.choice(1, 2, 3, 4, default=3)}
# the GEMVs' loop has no dot: a launch's num_stages pipelines nothing there, the loop's STAGES does
GEMV_TUNE = {"BLOCK_N": kd.pow2(1, 64, default=1), "BLOCK_KW": kd.pow2(8, 512, default=128),
             "MAGIC": kd.boolean(default=True),
             "num_warps": kd.choice(1, 2, 4, 8, default=4), "STAGES": kd.choice(1, 2, 3, 4, default=1)}


def _hooks(*, gemm: bool, glu: bool = False, combine: bool = False) -> dict:
    """The decorator arguments of one variant: its tuning bucket names the routing size, the weight's
    shape and format (and for the GEMM the block height, for a GLU the activation)."""
    def key(x, wq, scales, biases, *rest, **kw):
        routing = rest[2] if gemm else rest[0]
        k = {"M": routing.numel(), "N": wq.shape[1], "K": x.shape[1], "E": wq.shape[0], "bits": kw["BITS"],
             "gs": kw["GROUP"]}
        if gemm:
            k["BM"] = kw["BLOCK_M"]
        if glu:
            k["act"] = kw.get("ACT", "silu")
        elif kw.get("ACT", "none") != "none":
            k["act"] = kw["ACT"]
        return k

    def spec(*args, **kw):
        from kilnx.kernels.moe_specs import gather_spec
        act = kw.pop("ACT", "silu" if glu else "none")
        return gather_spec(*args, gemm=gemm, act=None if act == "none" else act, combine=combine, **kw)

    return dict(tune=GEMM_TUNE if gemm else GEMV_TUNE, key=key, spec=spec,
                default=_gemm_default if gemm else _gemv_default,
                specialize=_gemm_specialize if gemm else _gemv_specialize)


def _act(ACT: str):
    """A plain product's ACT constexpr as the helpers take it: None, or an ungated activation."""
    if ACT != "none" and ACT not in UNGATED:
        raise ValueError(f"ACT must be 'none' or one of {list(UNGATED)}, got {ACT!r}")
    return None if ACT == "none" else ACT


@kd.kernel(**_hooks(gemm=True))
def gather_qmm(x, wq, scales, biases, sorted_ids, block_expert, routing, *, BITS: kd.constexpr,
               GROUP: kd.constexpr, BLOCK_M: kd.constexpr, X_BY_TOKEN: kd.constexpr, DIVS: kd.constexpr,
               ACT: kd.constexpr = "none", BLOCK_N, BLOCK_K, MAGIC, PACKED):
    """(T * top_k, N): slot i = x[row of i] @ W[its expert]^T, or an UNGATED ACT of it. `routing` (T, top_k) is
    the expert ids (read for their shape only) or the routing weights (each row then scaled by its weight)."""
    return _gather_gemm(x, wq, scales, biases, sorted_ids, block_expert, routing, act=_act(ACT), combine=False,
                        BITS=BITS, GROUP=GROUP, BLOCK_M=BLOCK_M, X_BY_TOKEN=X_BY_TOKEN, DIVS=DIVS,
                        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, MAGIC=MAGIC,
                        PACKED=PACKED)


@kd.kernel(**_hooks(gemm=True, glu=True))
def gather_qmm_glu(x, wq, scales, biases, sorted_ids, block_expert, routing, *, BITS: kd.constexpr,
                   GROUP: kd.constexpr, BLOCK_M: kd.constexpr, X_BY_TOKEN: kd.constexpr,
                   ACT: kd.constexpr = "silu", DIVS: kd.constexpr, BLOCK_N, BLOCK_K, MAGIC, PACKED):
    """(T * top_k, N / 2): act(gate) * up of the [gate | up] product (weighted if routing is float)."""
    return _gather_gemm(x, wq, scales, biases, sorted_ids, block_expert, routing, act=ACT, combine=False,
                        BITS=BITS, GROUP=GROUP, BLOCK_M=BLOCK_M, X_BY_TOKEN=X_BY_TOKEN, DIVS=DIVS,
                        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, MAGIC=MAGIC,
                        PACKED=PACKED)


@kd.kernel(**_hooks(gemm=True, combine=True))
def gather_qmm_combine(x, wq, scales, biases, sorted_ids, block_expert, routing_weights, *, BITS: kd.constexpr,
                       GROUP: kd.constexpr, BLOCK_M: kd.constexpr, X_BY_TOKEN: kd.constexpr, DIVS: kd.constexpr,
                       BLOCK_N, BLOCK_K, MAGIC, PACKED):
    """(T, N) fp32 = sum_k routing_weights[t, k] * (slot (t, k) @ W[its expert]^T), added atomically."""
    return _gather_gemm(x, wq, scales, biases, sorted_ids, block_expert, routing_weights, act=None,
                        combine=True, BITS=BITS, GROUP=GROUP, BLOCK_M=BLOCK_M, X_BY_TOKEN=X_BY_TOKEN, DIVS=DIVS,
                        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, MAGIC=MAGIC,
                        PACKED=PACKED)


@kd.kernel(**_hooks(gemm=False))
def gather_qmv(x, wq, scales, biases, expert_ids, *, BITS: kd.constexpr, GROUP: kd.constexpr,
               X_BY_TOKEN: kd.constexpr, DIVS: kd.constexpr, SLOTS: kd.constexpr, ACT: kd.constexpr = "none",
               BLOCK_N, BLOCK_KW, MAGIC, STAGES):
    """(T * top_k, N): slot i = x[row of i] @ W[expert_ids.flat[i]]^T (or an UNGATED ACT of it), a GEMV per slot."""
    return _gather_gemv(x, wq, scales, biases, expert_ids, None, act=_act(ACT), BITS=BITS, GROUP=GROUP,
                        X_BY_TOKEN=X_BY_TOKEN, DIVS=DIVS, SLOTS=SLOTS, BLOCK_N=BLOCK_N, BLOCK_KW=BLOCK_KW,
                        MAGIC=MAGIC, STAGES=STAGES)


@kd.kernel(**_hooks(gemm=False, glu=True))
def gather_qmv_glu(x, wq, scales, biases, expert_ids, *, BITS: kd.constexpr, GROUP: kd.constexpr,
                   X_BY_TOKEN: kd.constexpr, ACT: kd.constexpr = "silu", DIVS: kd.constexpr, SLOTS: kd.constexpr,
                   BLOCK_N, BLOCK_KW, MAGIC, STAGES):
    """(T * top_k, N / 2): act(gate) * up per slot, one pass over x for both halves."""
    return _gather_gemv(x, wq, scales, biases, expert_ids, None, act=ACT, BITS=BITS, GROUP=GROUP,
                        X_BY_TOKEN=X_BY_TOKEN, DIVS=DIVS, SLOTS=SLOTS, BLOCK_N=BLOCK_N, BLOCK_KW=BLOCK_KW,
                        MAGIC=MAGIC, STAGES=STAGES)


@kd.kernel(**_hooks(gemm=False, combine=True))
def gather_qmv_combine(x, wq, scales, biases, expert_ids, routing_weights, *, BITS: kd.constexpr,
                       GROUP: kd.constexpr, X_BY_TOKEN: kd.constexpr, DIVS: kd.constexpr, SLOTS: kd.constexpr,
                       BLOCK_N, BLOCK_KW, MAGIC, STAGES):
    """(T, N) in x.dtype = sum_k routing_weights[t, k] * (x[row of (t, k)] @ W[expert_ids[t, k]]^T),
    summed inside the program (no atomics)."""
    return _gather_gemv(x, wq, scales, biases, expert_ids, routing_weights, act=None, BITS=BITS, GROUP=GROUP,
                        X_BY_TOKEN=X_BY_TOKEN, DIVS=DIVS, SLOTS=SLOTS, BLOCK_N=BLOCK_N, BLOCK_KW=BLOCK_KW,
                        MAGIC=MAGIC, STAGES=STAGES)


# ---- public ops -----------------------------------------------------------------------------------
def _check_weight(w, k: int, what: str):
    from kilnx.quant import QWeight
    if not isinstance(w, QWeight) or len(w.shape) != 3:
        raise ValueError(f"{what}: expected an (E, N, K) QWeight expert stack, got {getattr(w, 'shape', type(w))}")
    if w.mode != "affine" or 32 % w.bits:
        raise NotImplementedError(f"{what}: kernels for affine 2/4/8-bit weights only, got {w.mode} {w.bits}-bit")
    if w.shape[-1] != k:
        raise ValueError(f"{what}: weight {tuple(w.shape)} does not match the activations' last dim {k}")


def _check_routing(x, expert_ids, what: str):
    if expert_ids.shape[:-1] != x.shape[:-1] or expert_ids.dtype.is_floating_point:
        raise ValueError(f"{what}: expert_ids must be integers shaped (..., top_k) with x's leading dims "
                         f"{tuple(x.shape[:-1])}, got {expert_ids.dtype} {tuple(expert_ids.shape)}")


def gather_qmatmul(x: torch.Tensor, w, expert_ids: torch.Tensor) -> torch.Tensor:
    """kilnx.ops.gather_qmatmul: x (..., K), w (E, N, K), expert_ids (..., top_k) -> (..., top_k, N)."""
    _check_weight(w, x.shape[-1], "gather_qmatmul")
    _check_routing(x, expert_ids, "gather_qmatmul")
    lead, top_k, n = x.shape[:-1], expert_ids.shape[-1], w.shape[1]
    x2, ids = x.reshape(-1, x.shape[-1]), expert_ids.reshape(-1, top_k)
    if ids.numel() == 0:
        return x.new_empty(*lead, top_k, n)
    args = (x2, w.packed, w.scales, w.biases)
    if x2.shape[0] <= GATHER_QMV_MAX_TOKENS:
        y = gather_qmv(*args, ids)
    else:
        sorted_ids, block_expert, _ = align(ids, w.shape[0], align_block_m(ids.numel(), w.shape[0]))
        y = gather_qmm(*args, sorted_ids, block_expert, ids)
    return y.reshape(*lead, top_k, n)


def _moe_prepared(x, w_gate_up, w_down, expert_ids, routing_weights, activation):
    """moe() of activations already in qmv_h2's input form (kernels/prepared.py): the packed-fp16 decode
    kernels take them as they are. x (T, H) prepared, expert_ids / routing_weights (T, top_k)."""
    from kilnx.kernels import moe_h2
    rows, width = x.shape
    _check_weight(w_gate_up, width, "moe (gate_up)")
    _check_weight(w_down, w_gate_up.shape[1] // 2, "moe (down)")
    want = (32 // w_gate_up.bits, w_gate_up.group_size)
    if w_gate_up.bits not in moe_h2.BITS_SERVED or w_down.bits not in moe_h2.BITS_SERVED or x.format != want:
        raise ValueError(f"moe: prepared activations of format {x.format} serve 4/8-bit experts whose gate_up has "
                         f"(codes per word, group) {want}: here {w_gate_up.bits}/{w_down.bits}-bit; pass plain "
                         "activations instead")
    if rows > MOE_DECODE_MAX_TOKENS:
        raise ValueError(f"moe: prepared activations serve up to {MOE_DECODE_MAX_TOKENS} tokens, got {rows}; "
                         "pass plain activations")
    if expert_ids.shape[:-1] != (rows,) or routing_weights.shape != expert_ids.shape:
        raise ValueError(f"moe: expert_ids and routing_weights must be ({rows}, top_k) for {rows} prepared rows, "
                         f"got {tuple(expert_ids.shape)} and {tuple(routing_weights.shape)}")
    return moe_h2.moe_decode(x, w_gate_up, w_down, expert_ids, routing_weights, activation)


def moe(x, w_gate_up, w_down, expert_ids, routing_weights, activation: str = "silu") -> torch.Tensor:
    """kilnx.ops.moe: sum_k routing_weights[.., k] * down_e(act(gate_e x) * up_e x), e = expert_ids[.., k]; for
    an ungated activation (UNGATED: relu2) w_gate_up is up alone (E, F, H) and the expert is down_e(act(up_e x)).

    x (..., H); w_gate_up (E, 2F, H) laid out [gate | up]; w_down (E, H, F); expert_ids and
    routing_weights (..., top_k). Returns (..., H) in x.dtype. Up to MOE_DECODE_MAX_TOKENS tokens: per-slot
    GEMVs, no align step (on the GPU with 4/8-bit weights the packed-fp16 ones of kernels/moe_h2.py);
    more: align, then two grouped GEMMs."""
    if activation not in ACTIVATIONS and activation not in UNGATED:
        raise ValueError(f"moe: activation must be one of {sorted(ACTIVATIONS) + list(UNGATED)}, got {activation!r}")
    gated = activation in ACTIVATIONS
    from kilnx.kernels.prepared import PreparedX
    if isinstance(x, PreparedX):
        if not gated:
            raise ValueError("moe: prepared activations serve gated experts; pass plain activations for "
                             f"{activation!r}")
        return _moe_prepared(x, w_gate_up, w_down, expert_ids, routing_weights, activation)
    _check_weight(w_gate_up, x.shape[-1], "moe (gate_up)")
    _check_weight(w_down, w_gate_up.shape[1] // 2 if gated else w_gate_up.shape[1], "moe (down)")
    _check_routing(x, expert_ids, "moe")
    if w_down.shape[1] != x.shape[-1] or w_down.shape[0] != w_gate_up.shape[0]:
        raise ValueError(f"moe: down weight {tuple(w_down.shape)} does not map back to width {x.shape[-1]} "
                         f"for {w_gate_up.shape[0]} experts")
    if routing_weights.shape != expert_ids.shape:
        raise ValueError(f"moe: routing_weights {tuple(routing_weights.shape)} must match expert_ids "
                         f"{tuple(expert_ids.shape)}")
    lead, top_k, E = x.shape[:-1], expert_ids.shape[-1], w_gate_up.shape[0]
    x2, ids = x.reshape(-1, x.shape[-1]), expert_ids.reshape(-1, top_k)
    rw = routing_weights.reshape(-1, top_k)
    if ids.numel() == 0:
        return torch.zeros_like(x)
    gu = (w_gate_up.packed, w_gate_up.scales, w_gate_up.biases)
    dn = (w_down.packed, w_down.scales, w_down.biases)
    from kilnx.kernels import moe_h2    # built on this module's helpers
    if not gated:
        y = _moe_ungated(x2, w_gate_up, w_down, ids, rw, E, activation)
    elif x2.shape[0] <= MOE_DECODE_MAX_TOKENS and moe_h2.serves(w_gate_up, w_down):
        y = moe_h2.moe_decode(x2, w_gate_up, w_down, ids, rw, activation)
    elif x2.shape[0] <= MOE_DECODE_MAX_TOKENS:
        h = gather_qmv_glu(x2, *gu, ids, ACT=activation)
        y = gather_qmv_combine(h, *dn, ids, rw)
    else:
        sorted_ids, block_expert, _ = align(ids, E, align_block_m(ids.numel(), E))
        h = gather_qmm_glu(x2, *gu, sorted_ids, block_expert, ids, ACT=activation)
        y = _down_combined(h, dn, sorted_ids, block_expert, rw).to(x.dtype)
    return y.reshape(x.shape)


def _moe_ungated(x2, w_up, w_down, ids, rw, E: int, activation: str):
    """act(up_e x) (act in UNGATED), then down_e of it weighted and summed over the slots. At decode on the GPU the
    packed-fp16 kernels (moe_h2.ungated_decode); elsewhere up with the activation in its epilogue (the GEMV per slot,
    or the grouped GEMM after the align step), then down with the combine."""
    from kilnx.kernels import moe_h2
    up, dn = (w_up.packed, w_up.scales, w_up.biases), (w_down.packed, w_down.scales, w_down.biases)
    T = ids.shape[0]
    if T <= MOE_DECODE_MAX_TOKENS and moe_h2.serves(w_up, w_down):
        return moe_h2.ungated_decode(x2, w_up, w_down, ids, rw, activation)
    if T <= MOE_DECODE_MAX_TOKENS:
        return gather_qmv_combine(gather_qmv(x2, *up, ids, ACT=activation), *dn, ids, rw)
    sorted_ids, block_expert, _ = align(ids, E, align_block_m(ids.numel(), E))
    h = gather_qmm(x2, *up, sorted_ids, block_expert, ids, ACT=activation)
    return _down_combined(h, dn, sorted_ids, block_expert, rw).to(x2.dtype)


def _down_combined(h, dn, sorted_ids, block_expert, rw):
    """(T, H) fp32: the slots' down products (dn: packed, scales, biases) weighted and summed per token. On the GPU
    the grouped GEMM adds them atomically (gather_qmm_combine); elsewhere atomics run serially (the numba backend),
    so the GEMM writes each slot's weighted row in parallel and moe_sum_slots sums them (kernels/moe_combine.py)."""
    if h.is_cuda:
        return gather_qmm_combine(h, *dn, sorted_ids, block_expert, rw)
    from kilnx.kernels.moe_combine import moe_sum_slots
    return moe_sum_slots(gather_qmm(h, *dn, sorted_ids, block_expert, rw), TOP_K=rw.shape[1])


__all__ = ["gather_qmatmul", "moe", "gather_qmm", "gather_qmm_glu", "gather_qmm_combine", "gather_qmv",
           "gather_qmv_glu", "gather_qmv_combine", "align", "align_buffers", "GATHER_QMV_MAX_TOKENS",
           "MOE_DECODE_MAX_TOKENS"]

from kilnx.kernels import moe_specs as _specs  # noqa: E402 - tuning problems need the kernels above
_specs.register_tuning()
