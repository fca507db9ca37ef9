"""The 4-bit affine (group 64) product on Hopper's wgmma, the weight decoded into the tensor cores' register
operand straight from MLX's layout: `qmm_wg_direct`, no second copy of the weight (kernels/qmv_wg.py's
`qmm_wg` reads a repacked copy).

Why it can: a product's sum over K does not care in which order K is walked, so the weight's K order in the
operand may be any permutation as long as x is read in the same one. wgmma's A operand gives thread `lane` of
a quad (lane % 4 = l) the byte columns c = 4 j + l of its two rows (r and r + 8); here column c of a step of
GPI groups holds the row's byte
    m(c) = 64 half + 16 l + o,    with c = 4 (16 half + o) + l,   half < GPI / 2, o < 16,
so each thread's bytes of a row are 16 contiguous ones a half: one 16-byte load (cp.async) each, as the
repacked layout had. x is read at the same permutation (code 2 m(c) + h sits in K slot 2 c + h): its loads
are 4-byte pieces instead of 16-byte ones, a few kilobytes a step. The scales follow the bytes: column c is in
group 2 half + l // 2 of the step, so a step takes an even number of groups (GPI 2, 4, 8: K a multiple of 128).

Split over K, the last of a tile's programs to finish (an acquire-release count a tile) adds the partial sums
and writes y in x's dtype: qmm_wg's split wrote fp32 atomics into a zeroed output that qmatmul then cast, two
more kernels a call.

Compiled for sm_90 the loop keeps the weight out of shared memory apart from cp.async's staging, as
qmm_wg's (tests/kernels/test_wg_direct.py asserts it); it has ~20% more instructions a step than qmm_wg's
(628 against 527 SASS lines at 4 groups, mostly the scales' 2-byte reads): whether that costs time is the
GPU's to say (bench/bench_quant.py times both in the qmv cases).
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd

GS, ROWS, XROWS = 64, 64, 16     # group size; weight rows a program (wgmma's M); most x rows qmatmul sends here


def operand_order(k: int) -> torch.Tensor:
    """The K order the kernel walks: slot j of each 128-element block of K holds element operand_order[j] of
    it (module doc: slot 2 c + h holds code 2 m(c) + h). The same for every GPI: a step spans whole blocks."""
    slot = torch.arange(k)
    c, base = slot % 128 // 2, slot // 128 * 128
    return base + 2 * (16 * (c % 4) + c // 4) + slot % 2


def permute_k(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) in the kernel's K order: what a producer writing for X_PERMUTED would store."""
    return x[:, operand_order(x.shape[1]).to(x.device)]


def _spec(x, wb, scales, biases, done, *, X_PERMUTED=False, **_):
    """x @ W.T with W dequantized and rounded to x's dtype once, as the kernel's operand is (x given in the
    kernel's K order with X_PERMUTED)."""
    from kilnx.quant import QWeight
    w = QWeight.from_mlx(wb.view(torch.uint32), scales, biases, bits=4, group_size=GS).dequantize()
    if X_PERMUTED:
        x = torch.empty_like(x).index_copy_(1, operand_order(x.shape[1]).to(x.device), x)
    return (x.float() @ w.to(x.dtype).float().t()).to(x.dtype)


def _specialize(x, wb, scales, biases, *_):
    """G_DIV: the largest step of groups (up to 8) that divides the groups, so a step never runs past K."""
    return {"G_DIV": max(d for d in (1, 2, 4, 8) if scales.shape[1] % d == 0)}


def _default(x, wb, scales, biases, done, **_):
    """Up to 16 rows, 16 a program (up to 64, all the rows), and on the H200 (llama-3.1-8b's projections at
    4 rows, bench/results/2026-12-05_h200_qmv_direct_sweep_s21.csv) the best of 16 settings came from three
    rules: split K until the grid has ~1.9 programs an SM (qkv 4, o 4, down 4, gate_up 1); 8 groups a step
    where that grid still fits two programs an SM in one wave, else 4 (qkv at 8: 14.5 us against 10.5 at 4,
    its 384 programs past the SMs' room); one stage where a program walks at most 8 steps, else 3. More rows:
    128 a program, 64 where that leaves SMs without one. Starting points; `kilnx tune` stores the measured best."""
    from kilnx.kernels.dense_mm import sm_count
    sms, programs, g_div = sm_count(x), wb.shape[0] // ROWS, _specialize(x, wb, scales, biases)["G_DIV"]
    m = x.shape[0]
    if m > 64:
        return {"BLOCK_M": 128 if programs * -(-m // 128) >= sms else 64, "GPI": 2}
    split = next((sp for sp in (1, 2, 4) if programs * sp >= 1.9 * sms), 8)
    gpi = 8 if g_div == 8 and programs * split <= 2 * sms else min(4, g_div)
    steps = scales.shape[1] // gpi // split
    # 17-64 rows (not yet timed): all of x's rows in one program, the GEMV's rules otherwise
    block_m = XROWS if m <= XROWS else 32 if m <= 32 else 64
    stages = 1 if steps <= 8 else 2 if block_m * gpi >= 512 else 3    # 64 rows x 8 groups x 3 stages: 228 KB
    return {"BLOCK_M": block_m, "GPI": gpi, "SPLIT_K": split, "num_stages": stages}


@kd.kernel(tune={"BLOCK_M": kd.choice(16, 32, 64, 128, 256, default=128), "GPI": kd.choice(2, 4, 8, default=2),
                 "SPLIT_K": kd.choice(1, 2, 4, 8, default=1), "INTERLEAVE": kd.choice(False, True, default=False),
                 "num_stages": kd.choice(1, 2, 3, 4, default=3)},
           constraints=[lambda SPLIT_K, INTERLEAVE: SPLIT_K > 1 or not INTERLEAVE],
           key=lambda x, wb, scales, biases, done, **_: {"M": x.shape[0], "N": wb.shape[0], "K": x.shape[1]},
           spec=_spec, default=_default, specialize=_specialize)
def qmm_wg_direct(x, wb, scales, biases, done, *, G_DIV: kd.constexpr, BLOCK_M, GPI, SPLIT_K, INTERLEAVE=False,
                  X_PERMUTED: kd.constexpr = False):
    """y (M, N) = x (M, K) @ W.T; wb is MLX's 4-bit words as bytes (N, K/2) u8 (`w.packed.view(torch.uint8)`),
    scales and biases (N, K/64) bf16, `done` zeroed int32 tile counters (`counters_for`; left zeroed). GPI
    groups a K step (one dot of K = 64 GPI); K split over SPLIT_K programs, the last to finish a tile adds
    the partial sums. y (M, N) in x's dtype.

    INTERLEAVE: a tile's SPLIT_K programs launch next to each other and take its K steps in turn (program j
    steps j, j + SPLIT_K, ...), so at a time they read neighbouring 64 GPI-byte runs of the same 64 rows, where
    the plain split reads one run a row per program with the row's other runs in programs a wave apart. Why it
    may matter: a step reads 64 rows x 32 GPI bytes, 2-7 KB apart (K/2), where qmm_wg's repacked copy reads one
    8 KB run, and this kernel loses to that one only on the two projections bound by bandwidth (gate_up, down;
    bench/results/README.md, session 21). A guess until the GPU times it.

    X_PERMUTED (an input contract, not a tunable): x arrives already in the kernel's K order (`permute_k`), so
    a step reads it in contiguous 16-byte pieces instead of 4-byte ones gathered at the permutation — the
    other thing qmm_wg's repacked layout has and this kernel lacks. A producer (norm, SwiGLU) could write
    that order as they write qmv_h2's prepared input; whether it pays is for the GPU to say first (the bench
    times it with x permuted beforehand)."""
    M, K = x.shape
    N, G = scales.shape
    if G_DIV % GPI:
        raise kd.DSLError(f"qmm_wg_direct: GPI {GPI} groups a step must divide the {G_DIV}-multiple of groups "
                          "(K/64); K a multiple of 128 takes GPI 2")
    if INTERLEAVE:
        pk, pid, pm = kd.grid(SPLIT_K, kd.cdiv(N, ROWS), kd.cdiv(M, BLOCK_M))   # a tile's programs launch together
    else:
        pid, pm, pk = kd.grid(kd.cdiv(N, ROWS), kd.cdiv(M, BLOCK_M), SPLIT_K)
    HALF = GPI // 2
    # the bytes a step loads, in thread order: (o0, half, warp, lane // 4, lane % 4, o), 16 contiguous a thread
    e = kd.arange(0, 2048 * GPI)
    o, lo, hi, warp, half, o0 = e % 16, e // 16 % 4, e // 64 % 8, e // 512 % 4, e // 2048 % HALF, e // (2048 * HALF)
    wrow, wcol = pid * ROWS + 16 * warp + 8 * o0 + hi, 64 * half + 16 * lo + o
    # K slot k of the operand holds code 2 m(c) + h of the step's span (c = k // 2, h = k % 2; module doc)
    slot = kd.arange(0, GPI * GS)
    c = slot // 2
    code = 2 * (c // 64 * 64 + 16 * (c % 4) + c // 4 % 16) + slot % 2
    r64, gi = kd.arange(0, ROWS), kd.arange(0, GPI)
    mm = pm * BLOCK_M + kd.arange(0, BLOCK_M)
    steps = G // GPI
    per = kd.cdiv(steps, SPLIT_K)
    acc = kd.zeros((ROWS, BLOCK_M), kd.f32)
    first, stop, stride = (pk, steps, SPLIT_K) if INTERLEAVE else (pk * per, kd.minimum(pk * per + per, steps), 1)
    for step in kd.range(first, stop, stride):
        g0 = step * GPI
        raw = kd.load(wb, wrow, g0 * 32 + wcol, check=False)
        # -> rows (warp, o0, lane // 4), byte columns (half, o, lane % 4): the operand's order
        byt = kd.reshape(kd.permute(kd.reshape(raw, (2, HALF, 4, 8, 4, 16)), (2, 0, 3, 1, 5, 4)), (ROWS, GPI * 32))
        # a step's GPI scales a row, spread to the columns: column (half, o, lane % 4) is in group
        # 2 half + lane % 4 // 2
        s = kd.load(scales, pid * ROWS + r64[:, None], g0 + gi[None, :], check=False)
        b = kd.load(biases, pid * ROWS + r64[:, None], g0 + gi[None, :], check=False)
        s = kd.reshape(kd.broadcast_to(kd.reshape(s, (ROWS, HALF, 1, 2, 1)), (ROWS, HALF, 16, 2, 2)), (ROWS, GPI * 32))
        b = kd.reshape(kd.broadcast_to(kd.reshape(b, (ROWS, HALF, 1, 2, 1)), (ROWS, HALF, 16, 2, 2)), (ROWS, GPI * 32))
        a = kd.reshape(kd.nibbles(byt, s, b), (ROWS, GPI * GS))
        xk = slot if X_PERMUTED else code
        acc += kd.dot(a, kd.trans(kd.load(x, mm[:, None], g0 * GS + xk[None, :], check=(True, False))))
    rows = pid * ROWS + r64
    out = kd.output((M, N), x.dtype)
    if SPLIT_K == 1:
        kd.store(out, mm[None, :], rows[:, None], acc)
    else:
        # the last of a tile's SPLIT_K programs to finish adds the partial sums and writes y: no zeroed output
        # and no cast after (two more kernels in a decode graph, each a launch's latency at these sizes)
        part = kd.output((SPLIT_K, M, N), kd.f32, name="partials")
        kd.store(part, pk, mm[None, :], rows[:, None], acc)
        kd.barrier()                      # the program's partial stored before its count is published
        tile = pid * kd.cdiv(M, BLOCK_M) + pm
        last = kd.atomic_add(done, tile, 1, check=False) == SPLIT_K - 1
        total = kd.zeros((ROWS, BLOCK_M), kd.f32)
        for j in kd.static_range(SPLIT_K):
            total += kd.load(part, j, mm[None, :], rows[:, None], mask=last, check=(False, True, False))
        kd.store(out, mm[None, :], rows[:, None], total, mask=last)
        kd.store(done, tile, 0, mask=last, check=False)      # left as found, for the next call
    return out


def tile_counters(device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, at least `tiles` of them, that qmm_wg_direct leaves zeroed: one buffer a device,
    made once (a larger one when asked; the old ones stay alive for CUDA graphs that captured them). Calls
    on concurrent streams of one device would share it: qmatmul runs on one stream."""
    device = torch.device(device)
    have = _COUNTERS.setdefault(str(device), [])
    if not have or have[-1].numel() < tiles:
        have.append(torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device))
    return have[-1]


_COUNTERS: dict[str, list[torch.Tensor]] = {}


def counters_for(x: torch.Tensor, n: int) -> torch.Tensor:
    """The counters a call of x (M, K) against an (n, K) weight can use: a tile of 64 weight rows and 16
    of x's rows (the smallest BLOCK_M) each."""
    return tile_counters(x.device, n // ROWS * -(-x.shape[0] // XROWS))


# ----------------------------------------------------------------------------- tuning inputs
def make_args(problem: dict, device: str):
    """qmm_wg_direct's inputs for a problem {M, N, K}: qmatmul's random 4-bit weight, its words as bytes."""
    from kilnx.kernels.qmatmul import make_qmatmul_args
    x, wq, scales, biases = make_qmatmul_args({**problem, "bits": 4, "gs": GS}, device)
    return x, as_bytes(wq), scales, biases, counters_for(x, wq.shape[0])


def _dense(wb, scales, biases) -> torch.Tensor:
    """The bf16 weight the peer multiplies, kept for the last weight asked (the tuner times one at a time)."""
    cached = getattr(_dense, "cache", None)
    if cached is None or cached[0] is not wb or cached[1] is not scales:
        from kilnx.quant import QWeight
        w = QWeight.from_mlx(wb.view(torch.uint32), scales, biases, bits=4, group_size=GS).dequantize()
        _dense.cache = cached = (wb, scales, w.to(torch.bfloat16))
    return cached[2]


def _tolerance(args):
    from kilnx.kernels.qmatmul import affine_tolerance
    return affine_tolerance(args[0], *args[2:4], 4)


qmm_wg_direct.tuning(make_args=make_args, peer=lambda x, wb, s, b, done: x @ _dense(wb, s, b).t(),
                     problems=[{"M": m, "N": 4096, "K": 4096} for m in (4, 16, 128)])
qmm_wg_direct.tolerance = _tolerance


# ----------------------------------------------------------------------------- qmatmul's use
def takes_shape(n: int, k: int, group_size: int) -> bool:
    """The shapes qmm_wg_direct takes: an (n, k) weight in 64-code groups, n a multiple of 64 (wgmma's rows),
    k of 128 (a step takes an even number of groups)."""
    return group_size == GS and n % ROWS == 0 and k % (2 * GS) == 0


def takes(x: torch.Tensor, wq: torch.Tensor, scales: torch.Tensor, biases) -> bool:
    """Whether qmm_wg_direct takes x (M, K) @ W.T for MLX 4-bit group-64 words wq (N, K/8): N a multiple of 64,
    K of 128, bf16 activations, scales and biases (on any backend; the route's default sends calls here only
    on sm_90 and later). The format's bits and group size follow from the shapes: K/8 words a row, K/64 groups."""
    k = x.shape[1]
    return (wq.dim() == 2 and wq.element_size() == 4 and wq.shape[1] * 8 == k
            and scales.dim() == 2 and scales.shape[1] * GS == k and takes_shape(wq.shape[0], k, GS)
            and x.dtype == torch.bfloat16
            and scales.dtype == torch.bfloat16 and biases is not None and biases.dtype == torch.bfloat16)


def server_of(x: torch.Tensor, wq: torch.Tensor, backend: str | None = None):
    """The qmatmul call (x, wq, scales, biases) -> y through qmm_wg_direct, its tile counters fetched once."""
    done, wb = counters_for(x, wq.shape[0]), as_bytes(wq)
    return lambda x2, wq, s, b: qmm_wg_direct(x2, wb, s, b, done, backend=backend)


def as_bytes(wq: torch.Tensor) -> torch.Tensor:
    """MLX's 4-bit words (N, K/8) as the kernel reads them: (N, K/2) bytes, a view."""
    return wq.view(torch.uint8).reshape(wq.shape[0], -1)
