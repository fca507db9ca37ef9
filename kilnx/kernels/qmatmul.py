"""Quantized matmul in the DSL: y = x @ dequantize(w).T for MLX-affine weights.

- `qmv`: M <= 16 rows and 2/4/8-bit codes (whole codes per 32-bit word). One pass over the weight
  serves every row. Packed words are loaded whole along K and the codes of each word position are
  unrolled; scale and bias are applied once per group to partial sums:
  sum_k w_k x_k = sum_g s_g * sum_{k in g} q_k x_k + b_g * sum_{k in g} x_k.
  SPLIT_K > 1 splits K across programs that add into an fp32 output with atomics.
- `qmm`: any M, any bit width, a tiled GEMM that dequantizes a weight tile in registers and
  multiplies with kd.dot. 2/4/8-bit codes are read as whole words along K and expanded with a
  broadcast shift; 3/5/6-bit codes (which may straddle words) are read per element.
- `mm`: the dense tiled GEMM, for weights kept unquantized.
"""

from __future__ import annotations

import torch

import kilnx.dsl as kd


def _format_of(x, wq, scales, biases):
    """Bit width and group size follow from the shapes: K*bits/32 words and K/group scales per row."""
    k = x.shape[1]
    return {"BITS": wq.shape[1] * 32 // k, "GROUP": k // scales.shape[1]}


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _qmv_key(x, wq, scales, biases, **kw):
    f = _format_of(x, wq, scales, biases)
    return {"M": x.shape[0], "N": wq.shape[0], "K": x.shape[1], "bits": f["BITS"], "gs": f["GROUP"]}


def _qmv_spec(x, wq, scales, biases, *, BITS, GROUP, **_):
    return _dense_spec(x, wq, scales, biases, BITS, GROUP)


def _dense_spec(x, wq, scales, biases, bits, group):
    from kilnx.quant import QWeight
    w = QWeight.from_mlx(wq.cpu(), scales.cpu(), biases.cpu(), bits=bits, group_size=group)
    y = x.double().cpu() @ w.dequantize(torch.float32).double().T
    return y.to(x.dtype).to(x.device)


@kd.kernel(
    tune={"BLOCK_N": kd.pow2(1, 64, default=4), "BLOCK_KW": kd.pow2(8, 512, default=256),
          "SPLIT_K": kd.choice(1, 2, 4, 8, default=1), "num_warps": kd.choice(1, 2, 4, 8, default=4),
          "num_stages": kd.choice(1, 2, 3, 4, default=3)},
    key=_qmv_key, spec=_qmv_spec,
    specialize=lambda x, wq, s, b: {**_format_of(x, wq, s, b), "BLOCK_M": _pow2_at_least(x.shape[0])})
def qmv(x, wq, scales, biases, *, BITS: kd.constexpr, GROUP: kd.constexpr, BLOCK_M: kd.constexpr,
        BLOCK_N, BLOCK_KW, SPLIT_K):
    M, K = x.shape
    N, KW = wq.shape
    PER = 32 // BITS                 # codes per word
    WPG = GROUP // PER               # words per group
    G = max(BLOCK_KW // WPG, 1)      # groups per chunk of words
    CHUNK = G * WPG                  # whole groups per chunk
    MASK = (1 << BITS) - 1
    pid_n, pid_k = kd.grid(kd.cdiv(N, BLOCK_N), SPLIT_K)
    n = pid_n * BLOCK_N + kd.arange(0, BLOCK_N)
    rows = kd.arange(0, BLOCK_M)
    words_per_split = kd.cdiv(kd.cdiv(KW, SPLIT_K), CHUNK) * CHUNK
    w_start = pid_k * words_per_split
    w_stop = kd.minimum(w_start + words_per_split, KW)
    acc = kd.zeros((BLOCK_M, BLOCK_N), kd.f32)
    for w0 in kd.range(w_start, w_stop, CHUNK):
        wc = w0 + kd.arange(0, CHUNK)
        words = kd.load(wq, n[:, None], wc[None, :], hint="stream")
        g = w0 // WPG + kd.arange(0, G)
        s = kd.load(scales, n[:, None], g[None, :]).f32()
        b = kd.load(biases, n[:, None], g[None, :]).f32()
        codes = [((words >> (j * BITS)) & MASK).f32() for j in kd.static_range(PER)]
        # every row reuses the codes already in registers; one row needs no loop at all
        for m in (kd.static_range(1) if BLOCK_M == 1 else kd.range(0, M)):
            qx = xsum = None
            for j in kd.static_range(PER):
                xv = kd.load(x, m, wc * PER + j).f32()
                term = codes[j] * xv[None, :]
                qx = term if qx is None else qx + term
                xsum = xv if xsum is None else xsum + xv
            qx_g = kd.reshape(kd.sum(kd.reshape(qx, (BLOCK_N * G, WPG)), axis=1), (BLOCK_N, G))
            xs_g = kd.sum(kd.reshape(xsum, (G, WPG)), axis=1)
            row = kd.sum(qx_g * s + b * xs_g[None, :], axis=1)
            acc += row[None, :] if BLOCK_M == 1 else kd.where(rows[:, None] == m, row[None, :], 0.0)
    if SPLIT_K == 1:
        out = kd.output((M, N), x.dtype)
        kd.store(out, rows[:, None], n[None, :], acc)
    else:
        out = kd.output((M, N), kd.f32, zero=True)
        kd.atomic_add(out, rows[:, None], n[None, :], acc)
    return out


@kd.kernel(
    tune={"BLOCK_M": kd.pow2(16, 128, default=128), "BLOCK_N": kd.pow2(16, 256, default=128),
          "BLOCK_K": kd.pow2(32, 256, default=64), "num_warps": kd.choice(2, 4, 8, default=8),
          "num_stages": kd.choice(1, 2, 3, 4, default=3)},
    key=_qmv_key, spec=_qmv_spec, specialize=_format_of)
def qmm(x, wq, scales, biases, *, BITS: kd.constexpr, GROUP: kd.constexpr, BLOCK_M, BLOCK_N, BLOCK_K):
    M, K = x.shape
    N = wq.shape[0]
    MASK = (1 << BITS) - 1
    pm, pn = kd.grid(kd.cdiv(M, BLOCK_M), kd.cdiv(N, BLOCK_N))
    rm = pm * BLOCK_M + kd.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + kd.arange(0, BLOCK_N)
    acc = kd.zeros((BLOCK_M, BLOCK_N), kd.f32)
    for k0 in kd.range(0, K, BLOCK_K):
        rk = k0 + kd.arange(0, BLOCK_K)
        a = kd.load(x, rm[:, None], rk[None, :])
        if 32 % BITS == 0:
            # whole words along K (contiguous, coalesced), codes expanded by a broadcast shift:
            # code j of word w is element k = w * PER + j
            PER = 32 // BITS
            kw = k0 // PER + kd.arange(0, BLOCK_K // PER)
            words = kd.load(wq, rn[:, None], kw[None, :])
            shifts = kd.arange(0, PER) * BITS
            q = kd.reshape((words[:, :, None] >> shifts[None, None, :]) & MASK, (BLOCK_N, BLOCK_K))
            grp = (rk // GROUP)[None, :]
            s = kd.load(scales, rn[:, None], grp).f32()
            b = kd.load(biases, rn[:, None], grp).f32()
            w = kd.trans(q.f32() * s + b)
        else:
            # codes may straddle two words: read the bit window per element
            bit = rk * BITS
            wi = (bit >> 5)[:, None]
            sh = (bit & 31)[:, None]
            lo = kd.load(wq, rn[None, :], wi).to(kd.u32) >> sh.to(kd.u32)
            spill = sh > 32 - BITS
            hi = kd.load(wq, rn[None, :], wi + 1, mask=spill).to(kd.u32) << ((32 - sh) & 31).to(kd.u32)
            q = (lo | kd.where(spill, hi, 0)) & MASK
            grp = (rk // GROUP)[:, None]
            s = kd.load(scales, rn[None, :], grp).f32()
            b = kd.load(biases, rn[None, :], grp).f32()
            w = q.f32() * s + b
        acc += kd.dot(a.to(x.dtype), w.to(x.dtype))
    out = kd.output((M, N), x.dtype)
    kd.store(out, rm[:, None], rn[None, :], acc)
    return out


@kd.kernel(
    tune={"BLOCK_M": kd.pow2(16, 128, default=64), "BLOCK_N": kd.pow2(16, 256, default=64),
          "BLOCK_K": kd.pow2(16, 256, default=64), "num_warps": kd.choice(2, 4, 8, default=4),
          "num_stages": kd.choice(1, 2, 3, 4, default=3)},
    key=lambda x, w: {"M": x.shape[0], "N": w.shape[0], "K": x.shape[1]},
    spec=lambda x, w: (x.double() @ w.double().T).to(x.dtype))
def mm(x, w, *, BLOCK_M, BLOCK_N, BLOCK_K):
    M, K = x.shape
    N = w.shape[0]
    pm, pn = kd.grid(kd.cdiv(M, BLOCK_M), kd.cdiv(N, BLOCK_N))
    rm = pm * BLOCK_M + kd.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + kd.arange(0, BLOCK_N)
    acc = kd.zeros((BLOCK_M, BLOCK_N), kd.f32)
    for k0 in kd.range(0, K, BLOCK_K):
        rk = k0 + kd.arange(0, BLOCK_K)
        a = kd.load(x, rm[:, None], rk[None, :])
        b = kd.load(w, rn[None, :], rk[:, None])
        acc += kd.dot(a, b.to(x.dtype))
    out = kd.output((M, N), x.dtype)
    kd.store(out, rm[:, None], rn[None, :], acc)
    return out


QMV_MAX_ROWS = 16


def qmatmul(x: torch.Tensor, w) -> torch.Tensor:
    """x (..., K) @ w.T for a QWeight (affine) or a dense (N, K) tensor -> (..., N) in x.dtype."""
    from kilnx.quant import QWeight
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if not isinstance(w, QWeight):
        if w.dim() != 2 or w.shape[1] != k:
            raise ValueError(f"qmatmul: weight shape {tuple(w.shape)} does not match x's last dim {k}")
        return mm(x2, w).reshape(*lead, w.shape[0])
    if w.mode != "affine":
        raise NotImplementedError(f"qmatmul has no kernel for mode {w.mode!r} yet (affine only); "
                                  "use w.dequantize() for a dense weight")
    if w.shape[-1] != k or len(w.shape) != 2:
        raise ValueError(f"qmatmul: weight {w.shape} does not match x's last dim {k}")
    if x2.shape[0] == 0:
        return x.new_empty(*lead, w.shape[0])
    args = (x2, w.packed, w.scales, w.biases)
    # numba compiles qmv's per-row loop very slowly, so on the CPU only single rows take qmv
    max_rows = QMV_MAX_ROWS if x.is_cuda else 1
    if x2.shape[0] <= max_rows and 32 % w.bits == 0:
        y = qmv(*args)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
    else:
        y = qmm(*args)
    return y.reshape(*lead, w.shape[0])


def make_qmatmul_args(problem: dict, device: str):
    """Random packed words and small random scales/biases: a valid QWeight without quantizing on
    the host (quantizing 8B weights with the numpy reference would take minutes)."""
    m, n, k = problem["M"], problem["N"], problem["K"]
    bits, gs = problem.get("bits", 4), problem.get("gs", 64)
    g = torch.Generator(device="cpu").manual_seed(m * 7919 + n * 31 + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
    wq = torch.randint(-2**31, 2**31 - 1, (n, k * bits // 32), generator=g, dtype=torch.int64)
    wq = wq.to(torch.int32).to(device)
    scales = (torch.rand(n, k // gs, generator=g) * 0.02 + 0.001).to(torch.bfloat16).to(device)
    biases = (-scales.float() * (2 ** (bits - 1))).to(torch.bfloat16)
    return x, wq, scales, biases


def _dense_peer(x, wq, scales, biases):
    """cuBLAS (torch.matmul) on the dequantized bf16 weight: the peer a quantized kernel must beat."""
    w = getattr(_dense_peer, "_cache", {}).get(id(wq))
    if w is None:
        w = _dense_spec_weight(x, wq, scales, biases)
        _dense_peer._cache = {id(wq): w}
    return x @ w.T


def _dense_spec_weight(x, wq, scales, biases):
    f = _format_of(x, wq, scales, biases)
    from kilnx.quant import QWeight
    q = QWeight.from_mlx(wq.cpu(), scales.cpu(), biases.cpu(), bits=f["BITS"], group_size=f["GROUP"])
    return q.dequantize(torch.bfloat16).to(x.device)


QMV_PROBLEMS = [{"M": m, "N": 4096, "K": 4096, "bits": 4, "gs": 64} for m in (1, 4)]
QMM_PROBLEMS = [{"M": 512, "N": 4096, "K": 4096, "bits": 4, "gs": 64}]
qmv.tuning(make_args=make_qmatmul_args, problems=QMV_PROBLEMS, peer=_dense_peer)
qmm.tuning(make_args=make_qmatmul_args, problems=QMM_PROBLEMS, peer=_dense_peer)


def _matmul_tolerance(args):
    """(rtol, atol) for a K-long dot of bf16-rounded operands: elementwise relative error is
    meaningless where the sum cancels, so atol scales with sqrt(K) x rms(x) x the largest weight."""
    x, wq, scales, biases = args
    k = x.shape[1]
    bits = _format_of(*args)["BITS"]
    wmax = scales.float().abs().max().item() * (2 ** bits - 1) + biases.float().abs().max().item()
    xrms = x.float().pow(2).mean().sqrt().item()
    return 2e-2, 4e-3 * (k ** 0.5) * xrms * wmax


qmv.tolerance = _matmul_tolerance
qmm.tolerance = _matmul_tolerance
