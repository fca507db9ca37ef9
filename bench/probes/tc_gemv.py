"""Design probe (not a kilnx kernel): a 4-bit GEMV for 1-16 activation rows on wgmma, with the weight
decoded straight into the tensor cores' register operand: no shared-memory round trip for the weight.

Why: qmv_h2 costs ~3.4 SASS instructions per code at one row and its time grows with the rows (1.85x at
4 rows, 3.42x at 8 on gate_up; target <= 1.2x). Every tensor-core variant so far (qmv_tc, mma_probe,
qmm PACKED at 16 rows) stored the decoded weight tile to shared memory and read it back in the MMA
operand layout (compiled here for sm_90: qmm PACKED's TTGIR has `local_alloc` of the 64 x 128 bf16 tile),
a round trip, barriers and ~2x the instructions per code, which held them at 16-28% of copy at one row.

The layout: Triton keeps wgmma's A operand in registers when it comes from elementwise ops, one
`tl.join` and a reshape of a loaded tensor (two nested joins already send it through shared memory,
triton 3.6). With 4-bit codes, a byte holds two codes: decoding bytes into (low, high) nibbles is one
join. What remains is the byte tile's own layout change to the operand's; the host therefore stores each
(64 rows x 64 codes) block as 2048 bytes in the order the 128 threads of a warpgroup need them, 16
contiguous bytes a thread, so a 1-d load (16-byte vectors, coalesced) followed by a reshape/permute gives
the logical (64, 32) byte tile already in the operand layout, and the conversion vanishes:
    byte e of a block: o = e % 16, lane = e // 16 % 32, warp = e // 512
    row = 16 warp + 8 (o % 2) + lane // 4, byte column c = lane % 4 + 4 (o // 2)
    the byte holds codes k = 2c (low nibble) and 2c + 1 (high) of the block's group.
`compile_report()` checks that claim on the installed Triton for sm_90 (no GPU needed).

Math per group (64 codes): d = sum_k (128 + q_k) x_k on the tensor cores (bf16 "magic" values 128 + q are
exact); y += s * d + (b - 128 s) * sum_k x_k in fp32 (MLX affine: w = s q + b). x is prepared as the
(64 x 16) B tile of each group (rows past M zero) and its group sums: on the GPU that is what a producer
kernel would write, as qmv_h2's prep does.

Compiled for sm_90 here (no GPU; triton 3.6, the device's, and 3.9 give the same TTGIR): the A operand is a
register tensor, the only shared-memory tile is x's (64 x 16) B operand, no layout conversion before the
dot, for one warpgroup (64 rows) or two (128). The loop's SASS per 32 codes a thread (one group, triton
3.6): 116 instructions with the asm decode (24 PRMT, 16 LOP3, 8 SHF, 18 FFMA of the per-group scaling, 4
HGMMA, 2 barriers), 179 with the plain decode, 144 / 206 pipelined 3 deep; the same at any row count up to
16 (qmv_h2: ~27 per 8 codes at one row, growing with the rows). 16 of the PRMTs pack
(low, high) into the operand's registers after `tl.join`. A variant on 32-bit words (pairs at nibbles i and
i + 4, one LOP3 per pair, four k=16 dots per group) had no PRMT but four B tiles and 8 barriers a group:
135. Whether either streams near the copy rate is for the GPU to say.

  GPU run:   python bench/probes/tc_gemv.py [CSV]    (default $OUT/tc_gemv.csv; bench/device_run.sh tcgemv)
  CPU check: TRITON_INTERPRET=1 python -m pytest tests/kernels/test_tc_gemv_probe.py
  CPU smoke: TRITON_INTERPRET=1 python bench/probes/tc_gemv.py --smoke /tmp/tc_gemv.csv
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

from kilnx.codegen.triton_rt import NIBBLE_ASM  # the asm of kd.nibbles (kernels/qmv_wg.py's form)

BN, GS, BM = 64, 64, 16     # weight rows per warpgroup (wgmma's M), group size, padded x rows
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------- host side
# the operand layout is the library's (kernels/qmv_wg.py, written from this probe and tc_qmm.py)
from kilnx.kernels.qmv_wg import group_major, pack_operand as pack  # noqa: E402,F401


def prepared_x(x):
    """x (M <= 16, K) -> (each group's (64, 16) B tile, rows past M zero: (G, 64, 16) in x's dtype; the groups'
    sums of x: (G, M) fp32), what a producer kernel would write on the GPU."""
    m, k = x.shape
    xp = torch.zeros(BM, k, dtype=torch.float32, device=x.device)
    xp[:m] = x.float()
    g = xp.reshape(BM, k // GS, GS)
    return g.permute(1, 2, 0).to(x.dtype).contiguous(), g.sum(-1).t()[:, :m].contiguous()


# ----------------------------------------------------------------------------- the kernel
@triton.jit
def _nibbles(byt, ASM: tl.constexpr):
    """(low, high) nibbles of each byte as bf16 128 + q, joined along a new last axis. ASM: the same values,
    four bytes (one register) at a time: two byte permutes, two shifts, four LOP3 for 8 codes."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(NIBBLE_ASM, "=r,=r,=r,=r,r", [byt], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=4)
    else:
        lo = ((byt & 0xF).to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
        hi = ((byt >> 4).to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def tc_gemv_kernel(w_ptr, s_ptr, b_ptr, xt_ptr, xsum_ptr, y_ptr, N, G, M, GROUPS_PER_SPLIT,
                   ASM: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, WG: tl.constexpr):
    ROWS: tl.constexpr = 64 * WG                # WG warpgroups, 4 warps each, stacked along the rows
    pid, pk = tl.program_id(0), tl.program_id(1)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rr = tl.arange(0, ROWS)
    mm = tl.arange(0, 16)
    e = tl.arange(0, 2048 * WG)
    t = tl.arange(0, 64 * 16)
    acc = tl.zeros((ROWS, 16), tl.float32)
    g_stop = tl.minimum(pk * GROUPS_PER_SPLIT + GROUPS_PER_SPLIT, G)
    for g in range(pk * GROUPS_PER_SPLIT, g_stop):
        blk = pid * G + g
        byt = tl.load(w_ptr + blk * (2048 * WG) + e).reshape(4 * WG, 8, 4, 8, 2).permute(0, 4, 1, 3, 2)
        a = _nibbles(byt.reshape(ROWS, 32), ASM).reshape(ROWS, 64)
        xt = tl.load(xt_ptr + g * 1024 + t).reshape(64, 16)
        if UPCAST:      # the CPU interpreter's dot mis-multiplies bf16 operands
            d = tl.dot(a.to(tl.float32), xt.to(tl.float32))
        else:
            d = tl.dot(a, xt)
        s = tl.load(s_ptr + blk * ROWS + rr).to(tl.float32)
        b = tl.load(b_ptr + blk * ROWS + rr).to(tl.float32)
        xs = tl.load(xsum_ptr + g * M + mm, mask=mm < M, other=0.0)        # xsum (G, M)
        acc = tl.fma(s[:, None], d, acc)                     # two FMAs a value (written as one sum: three ops)
        acc = tl.fma((b - 128.0 * s)[:, None], xs[None, :], acc)
    mask = (mm[None, :] < M) & (rows[:, None] < N)
    if SPLIT:
        tl.atomic_add(y_ptr + mm[None, :] * N + rows[:, None], acc, mask=mask, sem="relaxed")
    else:
        tl.store(y_ptr + mm[None, :] * N + rows[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


def tc_gemv(x: torch.Tensor, packed: torch.Tensor, s_g: torch.Tensor, b_g: torch.Tensor, *, split_k: int = 1,
            asm: bool | None = None, prepared=None, num_stages: int = 1) -> torch.Tensor:
    """x (M, K) bf16 times the packed weight: (M, N) bf16 (fp32 when split over K)."""
    p, g, block = packed.shape
    wg = block // (BN * GS // 2)
    xt, xsum = prepared if prepared is not None else prepared_x(x)
    m, n = x.shape[0], p * BN * wg
    split = split_k > 1
    y = (torch.zeros if split else torch.empty)(m, n, dtype=torch.float32 if split else x.dtype, device=x.device)
    per = -(-g // split_k)
    tc_gemv_kernel[(p, split_k)](packed, s_g, b_g, xt, xsum, y, n, g, m, per,
                                 ASM=(not INTERP) if asm is None else asm, SPLIT=split, UPCAST=INTERP, WG=wg,
                                 num_warps=4 * wg, num_stages=num_stages)
    return y


# ----------------------------------------------------------------------------- static check (no GPU)
def compile_report(asm: bool = True, num_stages: int = 1, wg: int = 1) -> dict:
    """tc_gemv_kernel compiled for sm_90 (see `compiled_facts`)."""
    sig = {"w_ptr": "*u8", "s_ptr": "*bf16", "b_ptr": "*bf16", "xt_ptr": "*bf16", "xsum_ptr": "*fp32",
           "y_ptr": "*bf16", "N": "i32", "G": "i32", "M": "i32", "GROUPS_PER_SPLIT": "i32"}
    return compiled_facts(tc_gemv_kernel, sig, {"ASM": asm, "SPLIT": False, "UPCAST": False, "WG": wg},
                          num_warps=4 * wg, num_stages=num_stages)


def compiled_facts(fn, sig: dict, constexprs: dict, *, num_warps: int, num_stages: int) -> dict:
    """Compile a probe kernel for sm_90 with the installed Triton (pointers and N, K declared 16-aligned, as
    Triton specializes them on real tensors) and report where the weight goes (sass_count.operand_facts)."""
    from triton.backends.compiler import GPUTarget
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sass_count import operand_facts
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if a.endswith("_ptr") or a in ("N", "K")}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, attrs=attrs, constexprs=constexprs)
    return operand_facts(triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                        options={"num_warps": num_warps, "num_stages": num_stages}))


# ----------------------------------------------------------------------------- GPU timing
def cli(default_name: str) -> tuple[bool, str]:
    """A probe's command line: (--smoke, the CSV path: argv's, else $OUT/default_name); the bench's own
    modules (bench_kernels) made importable."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    smoke = "--smoke" in sys.argv           # CPU, TRITON_INTERPRET=1: the script's own path on tiny shapes
    args = [a for a in sys.argv[1:] if a != "--smoke"]
    path = args[0] if args else os.path.join(os.environ.get("OUT", ".scratch/out"), default_name)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return smoke, path


def write_rows(path: str, rows: list[dict], smoke: bool, **extra) -> None:
    """The rows as CSV, each with the run's device, versions, date and commit."""
    import csv
    import datetime
    meta = {"device": "cpu (interpreter smoke)" if smoke else torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "date": datetime.date.today().isoformat(),
            "commit": os.environ.get("KILNX_COMMIT", "?"), **extra}
    with open(path, "w", newline="") as f:
        keys = list(dict.fromkeys(k for r in rows for k in r))       # rows of two kinds: every column once
        wr = csv.DictWriter(f, fieldnames=keys + list(meta))
        wr.writeheader()
        for r in rows:
            wr.writerow({**r, **meta})


def main() -> None:
    """llama-3.1-8b's four projections at 1-16 rows: the probe (split over K 1/2/4, plain and asm decode)
    against qmv_h2's path (prep + GEMV) and cuBLAS bf16 on the dequantized weight, all in one run, each
    over rotating weight copies (more bytes than L2 holds), CUDA-graph replayed (bench_kernels.time_calls)."""
    smoke, path = cli("tc_gemv.csv")
    import itertools
    from bench_kernels import copies_for, copy_gbps, time_calls          # the bench's own protocol
    from kilnx.kernels import qmv_h2 as H
    from kilnx.kernels.qmatmul import dequantize_on_device, make_qmatmul_args
    dev = torch.device("cpu" if smoke else "cuda")
    copy = copy_gbps(smoke)
    rows = []
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    if smoke:
        shapes = {"tiny": (128, 256)}
    for name, (n, k) in shapes.items():
        nbytes = n * k // 2 + 2 * 2 * n * k // GS
        weights = []
        for _ in range(copies_for(nbytes, smoke)):
            # random words and scales, as the kernel bench makes them (quantizing on the host took seconds a copy)
            _, wq, s, b = make_qmatmul_args({"M": 1, "N": n, "K": k, "bits": 4, "gs": GS}, str(dev))
            weights.append((wq, s, b, {wg: (pack(wq, wg), group_major(s, wg), group_major(b, wg)) for wg in (1, 2)}))
        dense = [dequantize_on_device(*w[:3], 4, GS).bfloat16() for w in weights]
        for m in (1, 5) if smoke else (1, 2, 4, 8, 16):
            x = torch.randn(m, k, device=dev).bfloat16()
            ref = x.float() @ dense[0].float().t()
            prepared = prepared_x(x)
            us_cublas = 1e6 * time_calls(lambda d: x @ d.t(), [(d,) for d in dense])
            us_h2 = 1e6 * time_calls(lambda a, bq, c: H.run_qmv_h2(x, a, bq, c), [w[:3] for w in weights])
            # the asm decode over splits x stages x warpgroups, and the plain decode once as its reference
            configs = [(sp, not smoke, st, wg) for sp, st, wg in itertools.product((1, 2, 4), (1, 3), (1, 2))]
            for split, asm, st, wg in configs + ([] if smoke else [(1, False, 1, 1)]):
                kw = {"split_k": split, "asm": asm, "prepared": prepared, "num_stages": st}
                y = tc_gemv(x, *weights[0][3][wg], **kw)
                err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                us = 1e6 * time_calls(lambda p_, s_, b_: tc_gemv(x, p_, s_, b_, **kw), [w[3][wg] for w in weights])
                rows.append({"case": f"tc_gemv_b4_M{m}_{name}", "split_k": split, "asm": asm, "stages": st, "wg": wg,
                             "us": round(us, 2),
                             "GBps": round(nbytes / us / 1e3, 1), "pct_copy": round(100 * nbytes / us / 1e3 / copy, 1),
                             "us_qmv_h2_path": round(us_h2, 2), "us_cublas_bf16": round(us_cublas, 2),
                             "rel_err": f"{err:.2e}"})
                print(rows[-1], flush=True)
    write_rows(path, rows, smoke, copy_GBps=round(copy, 1))

if __name__ == "__main__":
    main()
