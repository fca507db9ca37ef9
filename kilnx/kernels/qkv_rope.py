"""The qkv projection of a decode step with rotary embedding and the KV-cache write as its epilogue.

Why: a llama layer's decode step ran the qkv GEMV, then `rope_cache_kernel` (rotate q in place, write
rotated k and v into the caches): a launch of almost no work per layer, 3.6 us of a 2.45 ms llama-3.1-8b
step on the H200 times 32 layers, plus its launch gap. Here the GEMV's programs finish the job: a
program owns BLOCK_N/2 rotary pairs of one head (the pair's two weight rows are any two rows of the
weight, so the program simply loads those rows: neox pairs row i of a head with row i + D/2,
interleaved with i + 1), rotates its results in registers and stores q, or k and v straight into the
caches. Same values as the two-kernel path: results are rounded to the activation dtype before the
rotation, as the stored qkv was.

Served: 4/8-bit affine weights through qmv_h2 (activations prepared by the producer before it), full
rotary width (R = D), one weight for q, k and v, no qkv bias and no q/k norms (those sit between the
projection and the rotation). Anything else takes qmatmul + rope_and_cache_.
"""

from __future__ import annotations

import os

import torch

import kilnx.dsl as kd
from kilnx.kernels import _gemv as gemv
from kilnx.kernels import qmv_h2 as H

from kilnx.kernels.rope import _rope_cache_spec
from kilnx.kernels.sizes import pow2_at_least, pow2_dividing

TUNE = {"BLOCK_N": kd.pow2(2, 64, default=8), "BLOCK_KW": kd.pow2(8, 512, default=128),
        "num_warps": kd.choice(1, 2, 4, 8, default=2), "STAGES": kd.choice(1, 2, 3, 4, default=3),
        "CHAIN": kd.choice(1, 2, 4, default=1)}


def first_members(pid_n, slot, *, BLOCK_N: int, D: int, INTERLEAVED: bool):
    """(rows, offset): the first members of program pid_n's rotary pairs number `slot` (0 .. BLOCK_N/2-1;
    weight rows, all of one head) and the distance to their partners (neox D/2, interleaved 1)."""
    if INTERLEAVED:
        return pid_n * BLOCK_N + 2 * slot, 1
    per_head = D // BLOCK_N
    return (pid_n // per_head) * D + (pid_n % per_head) * (BLOCK_N // 2) + slot, D // 2


def pair_rows(pid_n, *, BLOCK_N: int, D: int, INTERLEAVED: bool):
    """Program pid_n's BLOCK_N weight rows: the first members of its pairs, then their partners."""
    i = kd.arange(0, BLOCK_N)
    first, offset = first_members(pid_n, i % (BLOCK_N // 2), BLOCK_N=BLOCK_N, D=D, INTERLEAVED=INTERLEAVED)
    return first + (i // (BLOCK_N // 2)) * offset


def _spec(planes, sums, xs, wq, scales, biases, positions, rows, inv_freq, k_cache, v_cache, *, HQ, INTERLEAVED=False,
          **kw):
    """q rotated (M, HQ*D) in scales' dtype; the caches get rotated k and v at [rows[m], :, positions[m], :]
    (checked by the tests; the kernel returns q)."""
    qkv = H._spec(planes, sums, xs, wq, scales, biases, **kw)
    D, hk = k_cache.shape[3], k_cache.shape[1]
    m = qkv.shape[0]
    q, k, v = qkv[:, :HQ * D].view(m, HQ, D), qkv[:, HQ * D:(HQ + hk) * D].view(m, hk, D), qkv[:, (HQ + hk) * D:]
    qr, _, _ = _rope_cache_spec(q, k, v.reshape(m, hk, D), positions, rows, inv_freq, k_cache, v_cache,
                                INTERLEAVED=INTERLEAVED)
    return qr.reshape(m, HQ * D)


def _key(planes, sums, xs, wq, scales, biases, *_, **__):
    return H._key(planes, sums, xs, wq, scales, biases)


def _default(planes, sums, xs, wq, scales, biases, *_, **__):
    """The config qmv_h2 would run the same product with (its tuned one for this device and bucket where
    there is one: the main loop is qmv_h2's), without split-K."""
    from kilnx.runtime.dispatch import config_for
    cfg = config_for(H.qmv_h2, (planes, sums, xs, wq, scales, biases), {})
    return {k: v for k, v in cfg.items() if k in TUNE}


def _specialize(planes, sums, xs, wq, scales, biases, positions, rows, inv_freq, k_cache, v_cache):
    return {**H._format(planes, sums, xs, wq, scales, biases), "BLOCK_M": pow2_at_least(planes.shape[0]),
            "N_DIV": pow2_dividing(wq.shape[0]), "KW_DIV": pow2_dividing(wq.shape[1]), "D": k_cache.shape[3],
            "R": 2 * inv_freq.shape[0], "HQ": wq.shape[0] // k_cache.shape[3] - 2 * k_cache.shape[1]}


@kd.kernel(tune=TUNE, key=_key, spec=_spec, default=_default, specialize=_specialize)
def qkv_rope_cache_h2(planes, sums, xs, wq, scales, biases, positions, rows, inv_freq, k_cache, v_cache, *,
                      BITS: kd.constexpr, GROUP: kd.constexpr, BLOCK_M: kd.constexpr, N_DIV: kd.constexpr,
                      KW_DIV: kd.constexpr, D: kd.constexpr, R: kd.constexpr, HQ: kd.constexpr,
                      INTERLEAVED: kd.constexpr = False, BLOCK_N, BLOCK_KW, STAGES,
                      CHAIN):
    """x @ w_qkv.T for prepared x (M rows, token m at positions[m] of cache row rows[m]) -> q (M, HQ*D)
    rotated; rotated k and v written into k_cache, v_cache (B, Hk, S, D)."""
    if D % BLOCK_N or R != D:
        raise kd.DSLError(f"qkv_rope_cache_h2 needs whole rotary pairs of a head per program and full rotary "
                          f"width: head dim {D}, BLOCK_N {BLOCK_N}, rotary width {R}")
    M = planes.shape[0]
    N, KW = wq.shape
    Hk = k_cache.shape[1]
    f = gemv.Frame(N, KW, WPG=GROUP * BITS // 32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_KW=BLOCK_KW, SPLIT_K=1,
                   N_DIV=N_DIV, KW_DIV=KW_DIV, STAGES=STAGES,
                   rows_of=lambda pid: pair_rows(pid, BLOCK_N=BLOCK_N, D=D, INTERLEAVED=INTERLEAVED))
    acc = H.accumulate(f, planes, sums, xs, wq, scales, biases, BITS=BITS, chain=min(CHAIN, f.WPG))
    # rounded as the stored qkv output was, then rotated in fp32 as rope_cache_kernel does
    a, b = kd.halves(kd.reshape(acc.astype(scales.dtype).f32(), (BLOCK_M, 2, BLOCK_N // 2)), axis=1)
    first, offset = first_members(kd.program_id(0), kd.arange(0, BLOCK_N // 2), BLOCK_N=BLOCK_N, D=D,
                                  INTERLEAVED=INTERLEAVED)
    first = first[None, :]
    head, dim_a = first // D, first % D
    dim_b = dim_a + offset
    m = kd.arange(0, BLOCK_M)
    m_in = (m < M)[:, None]
    pos = kd.load(positions, m, mask=m < M)[:, None]
    angle = pos.f32() * kd.load(inv_freq, dim_a // 2 if INTERLEAVED else dim_a).f32()
    cos, sin = kd.cos(angle), kd.sin(angle)
    is_v = head >= HQ + Hk
    ra = kd.where(is_v, a, a * cos - b * sin)
    rb = kd.where(is_v, b, b * cos + a * sin)
    q = kd.output((M, HQ * D), scales.dtype, name="q")
    is_q = m_in & (head < HQ)
    kd.store(q, m[:, None], first, ra, mask=is_q)
    kd.store(q, m[:, None], first + offset, rb, mask=is_q)
    row = kd.load(rows, m, mask=m < M)[:, None]
    is_k = m_in & (head >= HQ) & (head < HQ + Hk)
    for cache, h0, region in ((k_cache, HQ, is_k), (v_cache, HQ + Hk, m_in & is_v)):
        kv_head = kd.where(region, head - h0, 0)
        kd.store(cache, row, kv_head, pos, dim_a, ra, mask=region)
        kd.store(cache, row, kv_head, pos, dim_b, rb, mask=region)
    return q


def _problem_args(problem: dict, device: str):
    """{M, Hq, Hk, D, K, bits, gs[, S]}: prepared activations, a qkv weight, positions over a cache of S
    (4096) positions."""
    from kilnx.kernels.qmatmul import make_qmatmul_args
    M, Hq, Hk, D = problem["M"], problem["Hq"], problem["Hk"], problem["D"]
    x, wq, scales, biases = make_qmatmul_args({"M": M, "N": (Hq + 2 * Hk) * D, "K": problem["K"],
                                               "bits": problem.get("bits", 4), "gs": problem.get("gs", 64)}, device)
    f = H._format_of(x, wq, scales, biases)
    planes, sums, xs = H._prep_spec(x.cpu(), PER=32 // f["BITS"], GROUP=f["GROUP"])
    S = problem.get("S", 4096)
    positions = torch.randint(0, S, (M,)).to(device)
    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))).to(device)
    k_cache = torch.zeros(M, Hk, S, D, dtype=scales.dtype, device=device)
    return (planes.to(device), sums.to(device), xs.to(device), wq, scales, biases, positions,
            torch.arange(M, device=device), inv_freq, k_cache, torch.zeros_like(k_cache))


qkv_rope_cache_h2.tuning(make_args=_problem_args,
                         problems=[{"M": 1, "Hq": 32, "Hk": 8, "D": 128, "K": 4096, "bits": 4, "gs": 64}])


def qkv_rope_cache(x, w, positions, rows, inv_freq, k_cache, v_cache, *, num_heads: int, interleaved: bool = False):
    """kilnx.ops.qkv_rope_cache for prepared x (a PreparedX): q (M, Hq, D) rotated; k, v into the caches."""
    if not serves(x, w, inv_freq, k_cache, num_heads):
        raise ValueError("qkv_rope_cache: this projection is not served fused (ask kilnx.ops.fuses_qkv_rope first)")
    q = qkv_rope_cache_h2(x.planes, x.sums, x.xs, w.packed, w.scales, w.biases, positions, rows, inv_freq,
                          k_cache, v_cache, INTERLEAVED=bool(interleaved))
    return q.view(x.shape[0], num_heads, k_cache.shape[3])


def enabled() -> bool:
    """KILNX_FUSED_QKV_ROPE=0 turns the fused path off (for comparisons)."""
    return os.environ.get("KILNX_FUSED_QKV_ROPE", "1") != "0"


def serves(x, w, inv_freq, k_cache, num_heads: int) -> bool:
    """Whether qkv_rope_cache_h2 computes this step: prepared activations for qmv_h2 in w's format, one
    (Hq + 2 Hk) * D row weight, full rotary width, a head dim its blocks divide (every pow2 up to 64)."""
    from kilnx.kernels.prepared import PreparedX
    from kilnx.quant import QWeight
    if not isinstance(x, PreparedX) or not isinstance(w, QWeight) or w.mode != "affine" or len(w.shape) != 2:
        return False
    D, hk = k_cache.shape[3], k_cache.shape[1]
    return (w.bits in H.BITS_SERVED and x.format == (32 // w.bits, w.group_size) and w.shape[1] == x.shape[1]
            and w.shape[0] == (num_heads + 2 * hk) * D and 2 * inv_freq.shape[0] == D and D % 64 == 0)


qkv_rope_cache_h2.tolerance = lambda args: H._tolerance(args[:6])   # qmv_h2's, on the same product
# the tuner starts from qmv_h2's seeds (a 1B tune kept this kernel's default at 8.06 us where qmv_h2 alone
# found 7.01 us on the same shape with a seed it had)
qkv_rope_cache_h2.seed_configs = lambda problem: [{k: v for k, v in c.items() if k in TUNE}
                                                  for c in H.qmv_h2.seed_configs(problem)]
