"""Small `@kd.kernel` tile kernels exercising the language, each checked on every backend.

For each kernel: the Triton source (run by the Triton interpreter), the numba lowering and the numpy
reference interpreter agree with each other and with a torch formula written here. Kernels cover:
kd.range loops with accumulators (`+=`, `.set`), nested loops, kd.static_range, kd.dot (tl.dot when
every dim >= 16, broadcast-multiply-and-sum below), kd.where, reductions with keepdims, `x[:, None]`,
kd.reshape, kd.trans, split-K kd.atomic_add into a zeroed kd.output (casts and bitcasts: test_casts.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kilnx.dsl as kd
from dsl_helpers import assert_close, randn

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")

FEW = settings(max_examples=4, deadline=None, derandomize=True)
BACKENDS = ["reference", "triton", "numba"]


def run_all(kernel, args, configs, *, numba=True, **kw):
    """{(backend, config index): outputs} for Triton and the reference over `configs`, and numba over
    the first config only: each numba specialisation (kernel x dtypes x config) is a slow compile."""
    out = {}
    for i, cfg in enumerate(configs):
        for backend in ("reference", "triton"):
            out[backend, i] = kernel(*args, backend=backend, config=cfg, **kw)
    if numba:
        out["numba", 0] = kernel(*args, backend="numba", config=configs[0], **kw)
    return out


def check_all(results, want, close=assert_close):
    for (backend, i), got in results.items():
        close(got, want, what=f"{backend} config #{i} vs torch")
        close(got, results["reference", 0], what=f"{backend} config #{i} vs reference")


# ---- kd.range with a `+=` accumulator; x[:, None]; masked loads -------------------------------------
@kd.kernel(tune={"BLOCK_M": kd.pow2(2, 8), "BLOCK_K": kd.pow2(16, 64), "STAGES": kd.choice(1, 3)})
def row_sum(x, *, BLOCK_M, BLOCK_K, STAGES):
    M, K = x.shape
    pid = kd.grid(kd.cdiv(M, BLOCK_M))
    rows = pid * BLOCK_M + kd.arange(0, BLOCK_M)
    acc = kd.zeros((BLOCK_M,), kd.f32)
    for k0 in kd.range(0, K, BLOCK_K, stages=STAGES if STAGES > 1 else None):
        cols = k0 + kd.arange(0, BLOCK_K)
        tile = kd.load(x, rows[:, None], cols[None, :])
        acc += kd.sum(tile.f32(), axis=1)
    out = kd.output((M,), kd.f32)
    kd.store(out, rows, acc)
    return out


@FEW
@given(m=st.sampled_from([1, 5, 8]), k=st.sampled_from([3, 40, 100]), seed=st.integers(0, 99))
def test_row_sum_range_loop_accumulator(m, k, seed):
    x = randn(m, k, seed=seed)
    res = run_all(row_sum, (x,), [{"BLOCK_M": 4, "BLOCK_K": 16}, {"BLOCK_M": 8, "BLOCK_K": 64, "STAGES": 3}])
    check_all(res, x.sum(-1))


def test_kernels_trace_under_cprofile():
    """Tracing names the IR after the author's locals through a profile hook; with cProfile running it
    leaves cProfile's hook alone and still traces (Python 3.11 cannot hand cProfile's hook back)."""
    import cProfile
    x = randn(3, 40, seed=1)
    prof = cProfile.Profile()
    prof.enable()
    try:
        src = row_sum.triton_source(x, config={"BLOCK_M": 4, "BLOCK_K": 16, "STAGES": 1})
    finally:
        prof.disable()
    assert "tl.store" in src
    # cProfile kept recording through the trace: the kernel's own function shows in its statistics
    assert any(getattr(e.code, "co_name", "") == "row_sum" for e in prof.getstats())


def test_range_stages_is_a_pipelining_hint_for_triton_only():
    """kd.range(..., stages=S) becomes tl.range(..., num_stages=S) (Triton pipelines a loop's loads only
    when it feeds a dot or the loop names its stages); the other backends run the same plain loop."""
    x = randn(4, 32)
    src = {s: row_sum.triton_source(x, config={"BLOCK_M": 4, "BLOCK_K": 16, "STAGES": s}) for s in (1, 3)}
    assert "num_stages=3" in src[3] and "tl.range(" in src[3]
    assert "tl.range(" not in src[1] and "num_stages" not in src[1]
    with pytest.raises(kd.DSLError, match="stages"):
        list(kd.range(0, 4, stages=0))


# ---- nested kd.range loops; an accumulator created inside the outer loop; 3-d loads -------------------
@kd.kernel(tune={"BLOCK_M": kd.choice(4, 8), "BLOCK_K": kd.choice(16)})
def weighted_batch_sum(x, *, BLOCK_M, BLOCK_K):
    """out[m] = sum_b (b + 1) * sum_k x[b, m, k]"""
    B, M, K = x.shape
    pid = kd.grid(kd.cdiv(M, BLOCK_M))
    rows = pid * BLOCK_M + kd.arange(0, BLOCK_M)
    total = kd.zeros((BLOCK_M,), kd.f32)
    for b in kd.range(0, B):
        part = kd.zeros((BLOCK_M, 1), kd.f32)
        for k0 in kd.range(0, K, BLOCK_K):
            cols = k0 + kd.arange(0, BLOCK_K)
            part += kd.sum(kd.load(x, b, rows[:, None], cols[None, :]), axis=1, keepdims=True)
        total += kd.reshape(part, (BLOCK_M,)) * (b + 1)
    out = kd.output((M,), kd.f32)
    kd.store(out, rows, total)
    return out


@FEW
@given(b=st.sampled_from([1, 3]), m=st.sampled_from([2, 9]), k=st.sampled_from([5, 33]), seed=st.integers(0, 99))
def test_nested_range_loops(b, m, k, seed):
    x = randn(b, m, k, seed=seed)
    weights = torch.arange(1, b + 1, dtype=torch.float32)[:, None]
    want = (x.sum(-1) * weights).sum(0)
    check_all(run_all(weighted_batch_sum, (x,), [{"BLOCK_M": 4}, {"BLOCK_M": 8}]), want)


# ---- kd.dot in both lowerings; `.set` accumulator; 16-bit inputs --------------------------------------
@kd.kernel(tune={"BLOCK_M": kd.choice(4, 16), "BLOCK_N": kd.choice(16, 32), "BLOCK_K": kd.choice(8, 16)})
def matmul(a, b, *, BLOCK_M, BLOCK_N, BLOCK_K):
    M, K = a.shape
    N = b.shape[1]
    pm, pn = kd.grid(kd.cdiv(M, BLOCK_M), kd.cdiv(N, BLOCK_N))
    rm = pm * BLOCK_M + kd.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + kd.arange(0, BLOCK_N)
    acc = kd.zeros((BLOCK_M, BLOCK_N), kd.f32)
    for k0 in kd.range(0, K, BLOCK_K):
        rk = k0 + kd.arange(0, BLOCK_K)
        acc.set(acc + kd.dot(kd.load(a, rm[:, None], rk[None, :]), kd.load(b, rk[:, None], rn[None, :])))
    c = kd.output((M, N), a.dtype)
    kd.store(c, rm[:, None], rn[None, :], acc)
    return c


TENSOR_CORE = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
BROADCAST_SUM = {"BLOCK_M": 4, "BLOCK_N": 16, "BLOCK_K": 8}


def test_dot_lowering_depends_on_tile_dims():
    a, b = randn(20, 24), randn(24, 18)
    assert "tl.dot(" in matmul.triton_source(a, b, config=TENSOR_CORE)
    small = matmul.triton_source(a, b, config=BROADCAST_SUM)
    assert "tl.dot(" not in small and "tl.sum(" in small


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@FEW
@given(m=st.sampled_from([1, 3, 20]), n=st.sampled_from([5, 18]), k=st.sampled_from([7, 24]),
       seed=st.integers(0, 99))
def test_matmul_both_dot_lowerings(dtype, m, n, k, seed):
    a, b = randn(m, k, dtype=dtype, seed=seed), randn(k, n, dtype=dtype, seed=seed + 1)
    want = (a.float() @ b.float()).to(dtype)
    res = run_all(matmul, (a, b), [TENSOR_CORE, BROADCAST_SUM], numba=dtype == torch.bfloat16)
    check_all(res, want, lambda g, w, what: assert_close(g, w, atol=1e-5, what=what))


# ---- kd.load_tile: a dense box (a TMA copy on the GPU), zeros past the bounds ----------------------------
@kd.kernel(tune={"BLOCK_M": kd.choice(16, 32), "BLOCK_N": kd.choice(16, 64), "BLOCK_K": kd.choice(16, 32)})
def matmul_boxes(a, b_t, *, BLOCK_M, BLOCK_N, BLOCK_K):
    """a (M, K) @ b_t (N, K).T with both operands read as boxes; the box of b_t transposed for the dot."""
    M, K = a.shape
    N = b_t.shape[0]
    pm, pn = kd.grid(kd.cdiv(M, BLOCK_M), kd.cdiv(N, BLOCK_N))
    acc = kd.zeros((BLOCK_M, BLOCK_N), kd.f32)
    for k0 in kd.range(0, K, BLOCK_K):
        acc += kd.dot(kd.load_tile(a, pm * BLOCK_M, k0, shape=(BLOCK_M, BLOCK_K)),
                      kd.trans(kd.load_tile(b_t, pn * BLOCK_N, k0, shape=(BLOCK_N, BLOCK_K))))
    c = kd.output((M, N), a.dtype)
    kd.store(c, pm * BLOCK_M + kd.arange(0, BLOCK_M)[:, None], pn * BLOCK_N + kd.arange(0, BLOCK_N)[None, :], acc)
    return c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@FEW
@given(m=st.sampled_from([1, 16, 37]), n=st.sampled_from([5, 64, 70]), k=st.sampled_from([8, 32, 72]),
       seed=st.integers(0, 99))
def test_load_tile_boxes_read_zeros_past_the_bounds(dtype, m, n, k, seed):
    # K = 8 bf16 is 16 bytes, the narrowest row TMA takes; boxes hang past M, N and K in most draws
    a, b_t = randn(m, k, dtype=dtype, seed=seed), randn(n, k, dtype=dtype, seed=seed + 1)
    want = (a.float() @ b_t.float().T).to(dtype)
    res = run_all(matmul_boxes, (a, b_t), [{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16},
                                          {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32}], numba=dtype == torch.float32)
    check_all(res, want, lambda g, w, what: assert_close(g, w, atol=1e-5, what=what))


def test_load_tile_lowers_to_one_descriptor_per_box_made_before_the_loop():
    a, b_t = randn(32, 64), randn(64, 64)
    src = matmul_boxes.triton_source(a, b_t, config={"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32})
    head, rest = src.split("for k0 in", 1)
    loop = "\n".join(line for line in rest.splitlines()[1:] if line.startswith(" " * 8))
    assert head.count("tl.make_tensor_descriptor(") == 2 and "tl.make_tensor_descriptor(" not in loop
    assert "a_box32x32.load([" in loop and "b_t_box64x32.load([" in loop
    assert "tl.arange" not in loop        # the box's index tiles are not computed where TMA reads it


def test_load_tile_refuses_a_tensor_tma_cannot_read():
    a = randn(32, 64)[:, :40]             # a view whose rows are 256 bytes apart: TMA reads it
    b_t = randn(64, 80)[:, ::2]           # last dim not contiguous: TMA cannot
    with pytest.raises(ValueError, match="cannot be read by kd.load_tile.*contiguous"):
        matmul_boxes(a, b_t, backend="triton", config={"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32})


# ---- kd.atomic_add's old value: the last program to finish combines every program's result -----------
@kd.kernel(tune={"B": kd.choice(16, 32)})
def sum_by_last_program(x, counter, *, B):
    n = x.shape[0]
    p = kd.grid(kd.cdiv(n, B))
    part = kd.output((kd.cdiv(n, B),), kd.f32, name="part")
    kd.store(part, p, kd.sum(kd.load(x, p * B + kd.arange(0, B))))
    kd.barrier()                                         # every thread's store before the ticket
    last = kd.atomic_add(counter, 0, 1) == kd.cdiv(n, B) - 1
    j = kd.arange(0, 64)
    total = kd.output((1,), kd.f32, name="total")
    kd.store(total, 0, kd.sum(kd.load(part, j, mask=(j < kd.cdiv(n, B)) & last)), mask=last)
    kd.store(counter, 0, 0, mask=last)                   # ready for the next launch
    return total


@pytest.mark.parametrize("backend", BACKENDS)
@FEW
@given(n=st.sampled_from([1, 40, 1000]), seed=st.integers(0, 99))
def test_atomic_add_old_value_picks_the_last_program(backend, n, seed):
    x, counter = randn(n, seed=seed), torch.zeros(1, dtype=torch.int32)
    for _ in range(2):                                   # the counter is back at 0 after each launch
        got = sum_by_last_program(x, counter, backend=backend, config={"B": 16})
        assert_close(got, x.sum().reshape(1), atol=1e-4, what=backend)
        assert counter.item() == 0


# ---- split-K GEMV: kd.atomic_add into kd.output(zero=True); a runtime loop start ----------------------
@kd.kernel(tune={"BLOCK_N": kd.pow2(16, 64, default=16), "BLOCK_K": kd.pow2(16, 64, default=16),
                 "SPLIT_K": kd.choice(1, 2, 4, default=2)})
def gemv_split_k(w, x, *, BLOCK_N, BLOCK_K, SPLIT_K):
    """y = w @ x; program (n, s) sums the K-blocks s, s + SPLIT_K, ... and adds its part atomically."""
    N, K = w.shape
    pid_n, pid_k = kd.grid(kd.cdiv(N, BLOCK_N), SPLIT_K)
    rows = pid_n * BLOCK_N + kd.arange(0, BLOCK_N)
    acc = kd.zeros((BLOCK_N,), kd.f32)
    for k0 in kd.range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        cols = k0 + kd.arange(0, BLOCK_K)
        wt = kd.load(w, rows[:, None], cols[None, :]).f32()
        xv = kd.load(x, cols).f32()
        acc += kd.sum(wt * xv[None, :], axis=1)
    y = kd.output((N,), kd.f32, name="y", zero=True)
    kd.atomic_add(y, rows, acc)
    return y


@FEW
@given(n=st.sampled_from([1, 17, 40]), k=st.sampled_from([16, 50, 130]), seed=st.integers(0, 99))
def test_split_k_gemv_atomics(n, k, seed):
    w, x = randn(n, k, dtype=torch.bfloat16, seed=seed), randn(k, dtype=torch.bfloat16, seed=seed + 1)
    want = w.float() @ x.float()
    configs = [{"SPLIT_K": 4}, {"SPLIT_K": 1, "BLOCK_K": 64}, {"SPLIT_K": 2, "BLOCK_N": 64, "BLOCK_K": 32}]
    check_all(run_all(gemv_split_k, (w, x), configs), want,
              lambda g, w_, what: assert_close(g, w_, atol=1e-4, what=what))


# ---- kd.static_range unroll, int32 shifts and masks (4-bit codes), int->float casts -------------------
@kd.kernel(tune={"BLOCK_N": kd.choice(4, 8), "BLOCK_W": kd.choice(4)})
def dequant_int4(q, scale, *, BLOCK_N, BLOCK_W):
    """q (N, W) int32 words holding 8 unsigned 4-bit codes LSB-first: out[n, 8w + j] =
    (code_j(q[n, w]) - 8) * scale[n]."""
    N, W = q.shape
    pn, pw = kd.grid(kd.cdiv(N, BLOCK_N), kd.cdiv(W, BLOCK_W))
    rn = pn * BLOCK_N + kd.arange(0, BLOCK_N)
    rw = pw * BLOCK_W + kd.arange(0, BLOCK_W)
    words = kd.load(q, rn[:, None], rw[None, :])
    s = kd.load(scale, rn)[:, None]
    out = kd.output((N, W * 8), kd.f32)
    for j in kd.static_range(8):
        code = (words >> (4 * j)) & 0xF
        kd.store(out, rn[:, None], rw[None, :] * 8 + j, (code - 8).to(kd.f32) * s)
    return out


def unpack_int4(q: torch.Tensor) -> torch.Tensor:
    u = q.numpy().view(np.uint32)
    codes = (u[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    return torch.from_numpy(codes.reshape(q.shape[0], -1).astype(np.int64))


@FEW
@given(n=st.sampled_from([1, 6]), w=st.sampled_from([3, 5]), seed=st.integers(0, 99))
def test_static_range_unpacks_int4_codes(n, w, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2**31, 2**31 - 1, (n, w), dtype=torch.int32, generator=g)
    q[0, 0] = -1          # every code 15: arithmetic right shifts must be masked off
    scale = randn(n, seed=seed, shift=1.0)
    want = (unpack_int4(q) - 8).float() * scale[:, None]
    assert "for " not in dequant_int4.triton_source(q, scale, config={"BLOCK_N": 4})   # unrolled
    check_all(run_all(dequant_int4, (q, scale), [{"BLOCK_N": 4}, {"BLOCK_N": 8}]), want)


# ---- reductions with keepdims and kd.where: a masked row softmax ---------------------------------------
@kd.kernel(tune={"BLOCK_M": kd.choice(2, 4), "BLOCK_D": kd.choice(128)})
def softmax(x, *, BLOCK_M, BLOCK_D):
    M, D = x.shape
    pid = kd.grid(kd.cdiv(M, BLOCK_M))
    rows = pid * BLOCK_M + kd.arange(0, BLOCK_M)
    cols = kd.arange(0, BLOCK_D)
    inside = cols[None, :] < D
    v = kd.load(x, rows[:, None], cols[None, :], mask=inside, other=float("-inf")).f32()
    m = kd.max(v, axis=1, keepdims=True)
    e = kd.where(inside, kd.exp(v - m), 0.0)
    p = e / kd.sum(e, axis=1, keepdims=True)
    out = kd.output((M, D), x.dtype)
    kd.store(out, rows[:, None], cols[None, :], p, mask=inside)
    return out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # rows past M are all -inf (never stored)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@FEW
@given(m=st.sampled_from([1, 4, 5]), d=st.sampled_from([1, 50, 128]), seed=st.integers(0, 99))
def test_softmax_keepdims_reductions_and_where(dtype, m, d, seed):
    x = randn(m, d, dtype=dtype, seed=seed, scale=3.0)
    want = torch.softmax(x.float(), -1).to(dtype)
    check_all(run_all(softmax, (x,), [{"BLOCK_M": 2}, {"BLOCK_M": 4}]), want)


# ---- kd.reshape and kd.trans ------------------------------------------------------------------------
@kd.kernel(tune={"BLOCK": kd.choice(8, 16)})
def pair_sum_transposed(x, *, BLOCK):
    """x (M, 2N) -> out (N, M) with out[j, i] = x[i, 2j] + x[i, 2j + 1]."""
    M, K = x.shape
    pm, pk = kd.grid(kd.cdiv(M, BLOCK), kd.cdiv(K, 2 * BLOCK))
    rm = pm * BLOCK + kd.arange(0, BLOCK)
    rk = pk * (2 * BLOCK) + kd.arange(0, 2 * BLOCK)
    tile = kd.load(x, rm[:, None], rk[None, :])                      # (BLOCK, 2 BLOCK)
    pairs = kd.reshape(tile, (BLOCK * BLOCK, 2)).sum(axis=1)         # neighbours along a row
    s = kd.reshape(pairs, (BLOCK, BLOCK))                            # s[i, j]
    rj = pk * BLOCK + kd.arange(0, BLOCK)
    out = kd.output((K // 2, M), x.dtype)
    kd.store(out, rj[:, None], rm[None, :], kd.trans(s))
    return out


@FEW
@given(m=st.sampled_from([3, 16, 20]), n=st.sampled_from([1, 7, 9]), seed=st.integers(0, 99))
def test_reshape_and_trans(m, n, seed):
    x = randn(m, 2 * n, seed=seed)
    want = (x[:, 0::2] + x[:, 1::2]).T.contiguous()
    check_all(run_all(pair_sum_transposed, (x,), [{"BLOCK": 8}, {"BLOCK": 16}]), want)


# ---- the GPU source (not the interpreter's variant) of each kernel compiles for sm_90 ----------------
from test_casts import casts, magic_codes, to_f16  # noqa: E402,F401 - compiled below with the others

GPU_CASES = [  # (kernel name, args maker, config)
    ("row_sum", lambda: (randn(5, 40),), {"BLOCK_M": 4, "BLOCK_K": 16}),
    ("row_sum", lambda: (randn(5, 40),), {"BLOCK_M": 4, "BLOCK_K": 16, "STAGES": 3}),
    ("weighted_batch_sum", lambda: (randn(2, 3, 4),), {"BLOCK_M": 4}),
    ("matmul", lambda: (randn(4, 4).bfloat16(), randn(4, 4).bfloat16()), TENSOR_CORE),
    ("matmul", lambda: (randn(4, 4).bfloat16(), randn(4, 4).bfloat16()), BROADCAST_SUM),
    ("gemv_split_k", lambda: (randn(4, 4).bfloat16(), randn(4).bfloat16()), {"SPLIT_K": 4}),
    ("dequant_int4", lambda: (torch.zeros(2, 2, dtype=torch.int32), randn(2)), {"BLOCK_N": 4}),
    ("softmax", lambda: (randn(2, 3),), {"BLOCK_M": 2}),
    ("pair_sum_transposed", lambda: (randn(2, 4),), {"BLOCK": 8}),
    ("casts", lambda: (randn(4),), {}),
    ("to_f16", lambda: (randn(4),), {}),
    ("magic_codes", lambda: (torch.zeros(4, dtype=torch.int32),), {}),
]
TL_PTR = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "i32": "i32", "i8": "i8"}


def _compile_for_gpu(name, make, cfg, unit_ints: bool):
    """Compile the generated GPU source for an sm_90 target (no GPU needed). With `unit_ints`, every
    int argument is 1, which Triton specializes into a constexpr."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget

    from kilnx.codegen import launch as L
    from kilnx.codegen.triton_gen import generate
    kernel = globals()[name]
    cfg = kernel.space.validate(cfg)
    ir = kernel.trace(cfg, make(), {})
    fn = getattr(L.load_module(generate(ir, header=f"{cfg}"), f"{name}_gpu_check"), name)
    dtypes = {p.name: p.dtype for p in ir.params + [o[0] for o in ir.outputs]}
    sig, constexprs = {}, {}
    for i, n in enumerate(inspect.signature(fn.fn).parameters):
        if n.endswith("_ptr"):
            sig[n] = "*" + TL_PTR[dtypes[n[:-4]]]
        elif unit_ints:
            sig[n], constexprs[(i,)] = "constexpr", 1
        else:
            sig[n] = "i32"
    src = triton.compiler.ASTSource(fn, signature=sig, constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def test_gpu_sources_compile_for_sm90():
    """The interpreter accepts more than the compiler (dot shapes, scalar/tile mixes, constexpr ints):
    compile every kernel above for the GPU, in a process without TRITON_INTERPRET."""
    import subprocess
    import sys
    from pathlib import Path
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_tile_kernels as t
for i, (name, make, cfg) in enumerate(t.GPU_CASES):
    t._compile_for_gpu(name, make, cfg, unit_ints=i % 2 == 1)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@kd.kernel(tune={"B": kd.choice(8)})
def _swap_halves(x, *, B):
    """Each row's interleaved pairs (x[2i], x[2i+1]) swapped, through kd.reshape and kd.halves."""
    row = kd.grid(x.shape[0])
    a, b = kd.halves(kd.reshape(kd.load(x, row, kd.arange(0, 2 * B)), (B, 2)), axis=1)
    out = kd.output(x.shape, x.dtype)
    kd.store(out, row, 2 * kd.arange(0, B), b)
    kd.store(out, row, 2 * kd.arange(0, B) + 1, a)
    return out


def test_halves_takes_an_axis_of_size_two_apart():
    x = torch.randn(3, 16)
    want = x.view(3, 8, 2).flip(-1).reshape(3, 16)
    for backend in BACKENDS:
        torch.testing.assert_close(_swap_halves(x, backend=backend), want)


@kd.kernel(tune={"B": kd.choice(8)})
def _halves_of_a_wrong_axis(x, *, B):
    out = kd.output(x.shape, x.dtype)
    kd.store(out, 0, kd.arange(0, B), kd.halves(kd.reshape(kd.load(x, 0, kd.arange(0, B)), (2, 4)), axis=1)[0])
    return out


def test_halves_of_an_axis_not_of_size_two_is_refused():
    with pytest.raises(kd.DSLError, match="axis of size 2"):
        _halves_of_a_wrong_axis(torch.randn(1, 8), backend="reference")


def test_a_launch_evaluates_its_grid_and_output_shapes_once_per_shape(monkeypatch):
    """Output shapes and the grid are host expressions of the argument shapes: a launch evaluates them
    once per distinct shapes (an eager prefill calls every kernel per layer) and still sizes each call
    by its own shapes."""
    from kilnx.codegen.launch import Launch
    evals = []
    real = Launch.host_eval
    monkeypatch.setattr(Launch, "host_eval", lambda self, *a: evals.append(1) or real(self, *a))
    cfg = {"BLOCK_M": 4, "BLOCK_K": 16, "STAGES": 1}
    for rows in (5, 5, 9, 5, 9):
        x = randn(rows, 40, seed=rows)
        got = row_sum(x, backend="triton", config=cfg)
        assert got.shape == (rows,)
        torch.testing.assert_close(got, x.float().sum(1), rtol=1e-5, atol=1e-5)
    assert len(evals) == 2 * 2        # (one output dim + one grid dim) x two distinct shapes
