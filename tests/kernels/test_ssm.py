"""kilnx/kernels/ssm.py: the Mamba-2 mixer's kernels against their float64 formulas, on the three backends.

Over random shapes (sequences of 1-9 tokens, several at once; channel and head counts off the blocks; K of 2-4
taps; P and N not powers of two) and configs (blocks smaller than the sizes, so tiles are masked and loops run):
the causal conv's output and its new window, the scan's output and its new state, and the gated group norm.
The position rules: a sequence at position 0 ignores its row's old state, one starting at `limit` (a parked row)
leaves its state exactly as it was, and tokens at `limit` after a sequence's first (padding) leave the state as the
tokens before them made it. Operands are the strided column slices a model passes (one projection's
[z | xBC | dt]).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import ssm

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")
BACKENDS = ["reference", "triton"]
LIMIT = 99


def _positions(g, nseq: int, T: int) -> torch.Tensor:
    """Each sequence's positions, one of: from 0 (a fresh start), from 5 (continuing its row's state), up to
    LIMIT (its last token is padding), from 5 with a random number of padding tokens at LIMIT after the first (a
    prompt padded to a graph's length), all at LIMIT (a parked row)."""
    out = []
    for _ in range(nseq):
        kind = int(torch.randint(0, 5, (1,), generator=g))
        pos = torch.arange(T) + [0, 5, LIMIT - T + 1, 5, LIMIT][kind]
        if kind == 3:
            pos[int(torch.randint(1, T + 1, (1,), generator=g)):] = LIMIT
        out.append(pos.clamp(max=LIMIT))
    return torch.cat(out)


@settings(max_examples=12, deadline=None)
@given(nseq=st.integers(1, 3), T=st.sampled_from([1, 2, 5, 9]), C=st.sampled_from([8, 24, 40]),
       K=st.sampled_from([2, 3, 4]), bias=st.booleans(), block_t=st.sampled_from([1, 4, 16]),
       block_c=st.sampled_from([16, 64]), backend=st.sampled_from(BACKENDS), seed=st.integers(0, 99))
def test_conv1d_silu_is_its_formula_and_updates_the_window(nseq, T, C, K, bias, block_t, block_c, backend, seed):
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(nseq * T, C + 7, generator=g)
    x = proj[:, 3:3 + C]                                           # a column slice, as the model passes it
    w, b = torch.randn(C, K, generator=g), torch.randn(C, generator=g) if bias else None
    state = torch.randn(nseq, K - 1, C, generator=g)
    pos = _positions(g, nseq, T)
    want, want_state = ssm.conv1d_silu_formula(x, w, b, state, pos, limit=LIMIT)
    got = ssm.conv1d_silu_(x, w, b, state, pos, limit=LIMIT, backend=backend,
                           config={"BLOCK_T": block_t, "BLOCK_C": block_c})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)   # the window is copied, not computed


@settings(max_examples=16, deadline=None)
@given(nseq=st.integers(1, 3), T=st.sampled_from([1, 3, 8, 21]), heads=st.sampled_from([(2, 1), (4, 2), (3, 3)]),
       P=st.sampled_from([4, 6, 16]), N=st.sampled_from([8, 12]), block_p=st.sampled_from([4, 8, 16]),
       dt_max=st.sampled_from([float("inf"), 0.05]), chunked=st.booleans(), backend=st.sampled_from(BACKENDS),
       seed=st.integers(0, 99))
def test_ssm_scan_is_the_recurrence_and_carries_the_state(nseq, T, heads, P, N, block_p, dt_max, chunked, backend,
                                                          seed):
    """Token by token, or a chunk at a time as products (16-token chunks: a 21-token sequence ends in a part chunk)."""
    g = torch.Generator().manual_seed(seed)
    H, G = heads
    n = nseq * T
    xbc = torch.randn(n, H * P + 2 * G * N, generator=g)
    x = xbc[:, :H * P].view(n, H, P)
    B, C = xbc[:, H * P:H * P + G * N].view(n, G, N), xbc[:, H * P + G * N:].view(n, G, N)
    dt = torch.randn(n, H + 3, generator=g)[:, 3:]                 # dt is the projection's last columns
    A_log, dt_bias, D = torch.rand(H, generator=g) * 2, torch.randn(H, generator=g) - 2, torch.randn(H, generator=g)
    state = torch.randn(nseq, H, P, N, generator=g)
    pos = _positions(g, nseq, T)
    want, want_state = ssm.ssm_scan_formula(x, dt, B, C, A_log, dt_bias, D, state, pos, limit=LIMIT, dt_max=dt_max)
    config = {"BLOCK_P": max(block_p, 16), "CHUNK": 16} if chunked else {"BLOCK_P": block_p}
    got = ssm.ssm_scan_(x, dt, B, C, A_log, dt_bias, D, state, pos, limit=LIMIT, dt_max=dt_max, backend=backend,
                        config=config, chunked=chunked)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 6), pad=st.integers(1, 12), start=st.sampled_from([0, 7]), chunked=st.booleans(),
       backend=st.sampled_from(BACKENDS), seed=st.integers(0, 99))
def test_padding_at_the_limit_leaves_the_state_the_prompt_alone_leaves(n, pad, start, chunked, backend, seed):
    """A prompt of n tokens padded with tokens at LIMIT (a prefill graph's fixed length): the conv's window, the
    scan's state and the prompt's outputs are those of the n tokens run alone, even where the padding's inputs are
    not finite (junk tokens' values)."""
    g = torch.Generator().manual_seed(seed)
    H, G, P, N, K = 4, 2, 8, 8, 4
    C = H * P + 2 * G * N
    xbc, dt = torch.randn(n + pad, C, generator=g), torch.randn(n + pad, H, generator=g)
    xbc[n:], dt[n:] = float("nan"), float("inf")
    w, b = torch.randn(C, K, generator=g), torch.randn(C, generator=g)
    A_log, dt_bias, D = torch.rand(H, generator=g) * 2, torch.randn(H, generator=g) - 2, torch.randn(H, generator=g)
    conv0, ssm0 = torch.randn(1, K - 1, C, generator=g), torch.randn(1, H, P, N, generator=g)
    pos = torch.cat([torch.arange(start, start + n), torch.full((pad,), LIMIT)])
    results = []
    for m in (n, n + pad):
        conv, state = conv0.clone(), ssm0.clone()
        u = ssm.conv1d_silu_(xbc[:m], w, b, conv, pos[:m], limit=LIMIT, backend=backend)
        xs, Bm, Cm = u[:, :H * P].view(m, H, P), u[:, H * P:H * P + G * N].view(m, G, N), u[:, H * P + G * N:].view(m, G, N)
        config = {"BLOCK_P": 16, "CHUNK": 16} if chunked else None
        y = ssm.ssm_scan_(xs, dt[:m], Bm, Cm, A_log, dt_bias, D, state, pos[:m], limit=LIMIT, backend=backend,
                          config=config, chunked=chunked)
        results.append((u[:n], y[:n], conv, state))
    alone, padded = results
    torch.testing.assert_close(padded[2], alone[2], rtol=0, atol=0)
    for got, want in zip(padded[:2] + padded[3:], alone[:2] + alone[3:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(alone[3], ssm0)                       # the prompt did move the state


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 4), groups=st.integers(1, 3), group=st.sampled_from([8, 12, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), backend=st.sampled_from(BACKENDS),
       seed=st.integers(0, 99))
def test_gated_rms_norm_normalizes_each_group_of_the_gated_values(n, groups, group, dtype, backend, seed):
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(n, 2 * groups * group, generator=g).to(dtype)
    z, y = proj[:, :groups * group], proj[:, groups * group:]
    w = torch.randn(groups * group, generator=g).to(dtype)
    got = ssm.gated_rms_norm(y, z, w, group, 1e-5, backend=backend)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), ssm.gated_rms_norm_formula(y, z, w, group, 1e-5).double(), rtol=tol,
                               atol=tol)


def test_the_numba_lowering_gives_the_same_three_results():
    """One fixed case per kernel through numba (each costs a compile on a cold cache)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(6, 24, generator=g), torch.randn(24, 4, generator=g), torch.randn(24, generator=g)
    state, pos = torch.randn(2, 3, 24, generator=g), torch.tensor([0, 1, 2, 7, 8, 9])
    want, want_state = ssm.conv1d_silu_formula(x, w, b, state, pos, limit=LIMIT)
    torch.testing.assert_close(ssm.conv1d_silu_(x, w, b, state, pos, limit=LIMIT, backend="numba"), want)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)
    xs, dt = torch.randn(6, 4, 6, generator=g), torch.randn(6, 4, generator=g)
    B, C = torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    A_log, dt_bias, D = torch.rand(4, generator=g), torch.randn(4, generator=g) - 2, torch.randn(4, generator=g)
    S = torch.randn(2, 4, 6, 8, generator=g)
    want, want_state = ssm.ssm_scan_formula(xs, dt, B, C, A_log, dt_bias, D, S, pos, limit=LIMIT)
    torch.testing.assert_close(ssm.ssm_scan_(xs, dt, B, C, A_log, dt_bias, D, S, pos, limit=LIMIT, backend="numba"),
                               want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S, want_state, rtol=1e-5, atol=1e-5)
    S = torch.randn(2, 4, 6, 8, generator=g)
    want, want_state = ssm.ssm_scan_formula(xs, dt, B, C, A_log, dt_bias, D, S, pos, limit=LIMIT)
    got = ssm.ssm_scan_(xs, dt, B, C, A_log, dt_bias, D, S, pos, limit=LIMIT, backend="numba", chunked=True,
                        config={"CHUNK": 16, "BLOCK_P": 16})
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S, want_state, rtol=1e-5, atol=1e-5)
    y, z, wn = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g), torch.randn(32, generator=g)
    torch.testing.assert_close(ssm.gated_rms_norm(y, z, wn, 16, 1e-5, backend="numba"),
                               ssm.gated_rms_norm_formula(y, z, wn, 16, 1e-5))


def test_the_formulas_are_mamba2s_recurrence_chunked_as_mlx_lm_computes_it():
    """The scan's formula against an independent implementation: mlx-lm's SSD (the quadratic, chunked form of the
    same recurrence) from a nonzero state."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models.ssm import ssm_attn
    import numpy as np
    g = torch.Generator().manual_seed(3)
    T, H, P, G, N = 7, 4, 6, 2, 8
    x, dt = torch.randn(T, H, P, generator=g), torch.randn(T, H, generator=g)
    B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    A_log, dt_bias, D = torch.rand(H, generator=g), torch.randn(H, generator=g) - 2, torch.randn(H, generator=g)
    S = torch.randn(1, H, P, N, generator=g)
    want, want_state = ssm.ssm_scan_formula(x, dt, B, C, A_log, dt_bias, D, S, torch.arange(3, 3 + T), limit=LIMIT)
    m = [mx.array(t.numpy()) for t in (x[None], A_log, B[None], C[None], D, dt[None], dt_bias, S)]
    y, state = ssm_attn(m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7], time_step_limit=(0.0, float("inf")))
    np.testing.assert_allclose(np.array(y)[0], want.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(state), want_state.numpy(), rtol=1e-4, atol=1e-4)


SM90_CASES = """
import torch
from kilnx.codegen.aot import compile_for_target
from kilnx.kernels import ssm
bf = torch.bfloat16
n, H, P, G, N, C = 4, 128, 64, 8, 128, 10240     # nemotron-h-8b's mixer, a 4-row decode step
proj = torch.randn(n, 8192 + C + H).to(bf)
x, dt = proj[:, 8192:8192 + C], proj[:, 8192 + C:]
pos = torch.arange(n)
compile_for_target(ssm.conv1d_silu_kernel, (x, torch.randn(C, 4).to(bf), torch.randn(C).to(bf),
                                            torch.zeros(n, 3, C).to(bf), pos), {"BLOCK_C": 128, "BLOCK_T": 16},
                   kw={"limit": 8191, "K": 4, "HAS_BIAS": True})
xs, B, Cm = x[:, :8192].view(n, H, P), x[:, 8192:9216].view(n, G, N), x[:, 9216:].view(n, G, N)
f = torch.zeros(H)
compile_for_target(ssm.ssm_scan_kernel, (xs, dt, B, Cm, f, f, f, torch.zeros(n, H, P, N), pos), {"BLOCK_P": 16},
                   kw={"limit": 8191, "dt_min": 0.0, "dt_max": float("inf"), "BLOCK_N": 128})
x2k = torch.randn(2048, 8192 + C + H).to(bf)
xs, dt = x2k[:, :8192].view(2048, H, P), x2k[:, 8192 + C:]
B, Cm = x2k[:, 8192:9216].view(2048, G, N), x2k[:, 9216:10240].view(2048, G, N)
ptx = compile_for_target(ssm.ssm_chunk_scan_kernel, (xs, dt, B, Cm, f, f, f, torch.zeros(1, H, P, N), torch.arange(2048)),
                         {"BLOCK_P": 32, "CHUNK": 64}, kw={"BLOCK_N": 128}).asm["ptx"]
assert "mma" in ptx, "the chunked scan's products are off the tensor cores"
compile_for_target(ssm.gated_rms_norm_kernel, (proj[:, :8192], proj[:, :8192], torch.ones(8192).to(bf)), {},
                   kw={"eps": 1e-5, "GROUP": 1024, "BLOCK_D": 1024})
print("ok")
"""


def test_the_kernels_compile_for_sm90_on_bf16_activations():
    """The Triton interpreter accepts programs the compiler rejects: each kernel compiled for an sm_90 target at
    nemotron-h-8b's sizes (bf16 activations, fp32 parameters and state), in a process without TRITON_INTERPRET."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SM90_CASES], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]
