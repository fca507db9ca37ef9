"""kilnx/kernels/qkv_rope.py: the qkv GEMV with rope and the KV-cache write as its epilogue equals the
two-kernel path it replaces, qmv_h2 then rope_cache_kernel's meaning: q rotated, and rotated k and v in
the caches at each row's position, nothing else in the caches touched.

Hypothesis over activation rows (each at its own position and cache row), head dims, grouped heads,
both rotary pair layouts, 4/8-bit codes, block widths from one pair to a whole half head and pipelined
or not, on the Triton interpreter; the numpy reference and numba on fixed cases."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import qkv_rope as QR
from kilnx.kernels import qmv_h2 as H
from kilnx.kernels.rope import _rope_cache_spec

CPU_ONLY = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                              reason="the CPU tests run Triton kernels under TRITON_INTERPRET=1")


def case(M, Hq, Hk, D, bits, seed):
    torch.manual_seed(seed)
    args = list(QR._problem_args({"M": M, "Hq": Hq, "Hk": Hk, "D": D, "K": 128, "bits": bits, "gs": 64, "S": 24},
                                 "cpu"))
    args[6] = torch.randperm(24)[:M]                      # distinct positions per row
    args[7] = torch.randperm(M)                           # rows in any order
    args[9], args[10] = torch.randn_like(args[9]), torch.randn_like(args[10])   # caches: untouched elsewhere
    return args


def two_kernel_path(args, Hq, interleaved, backend, cfg):
    planes, sums, xs, wq, scales, biases, positions, rows, inv_freq, k_cache, v_cache = args
    qkv = H.qmv_h2(planes, sums, xs, wq, scales, biases, backend=backend, config={**cfg, "SPLIT_K": 1})
    M, D, Hk = qkv.shape[0], k_cache.shape[3], k_cache.shape[1]
    q = qkv[:, :Hq * D].reshape(M, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hk) * D].reshape(M, Hk, D)
    v = qkv[:, (Hq + Hk) * D:].reshape(M, Hk, D)
    qr, kc, vc = _rope_cache_spec(q, k, v, positions, rows, inv_freq, k_cache, v_cache, INTERLEAVED=interleaved)
    return qr.reshape(M, Hq * D), kc, vc


def fused(args, Hq, interleaved, backend, cfg):
    a = list(args)
    a[9], a[10] = args[9].clone(), args[10].clone()
    q = QR.qkv_rope_cache_h2(*a, INTERLEAVED=interleaved, backend=backend, config=cfg)
    return q, a[9], a[10]


def check(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        # one rounding of the rotation (fp32 cos/sin against float64) on bf16 values
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-2, atol=1e-2 * w.double().abs().max().item())


@CPU_ONLY
@settings(max_examples=6, deadline=None, derandomize=True)
@given(M=st.sampled_from([1, 3]), D=st.sampled_from([64, 128]), heads=st.sampled_from([(2, 1), (3, 1)]),
       interleaved=st.booleans(), bits=st.sampled_from([4, 8]), block_n=st.sampled_from([4, 16, 64]),
       stages=st.sampled_from([1, 3]))
def test_fused_qkv_rope_cache_equals_the_two_kernel_path(M, D, heads, interleaved, bits, block_n, stages):
    Hq, Hk = heads
    args = case(M, Hq, Hk, D, bits, seed=M * 100 + D + bits)
    cfg = {"BLOCK_N": block_n, "BLOCK_KW": 64, "STAGES": stages}
    check(fused(args, Hq, interleaved, "triton", cfg), two_kernel_path(args, Hq, interleaved, "triton", cfg))


@CPU_ONLY
@pytest.mark.parametrize("backend,interleaved", [("reference", False), ("reference", True), ("numba", False)])
def test_fused_qkv_rope_cache_other_backends(backend, interleaved):
    args = case(2, 4, 2, 64, 4, seed=3)
    cfg = {"BLOCK_N": 8, "BLOCK_KW": 16, "STAGES": 1}
    check(fused(args, 4, interleaved, backend, cfg), two_kernel_path(args, 4, interleaved, backend, cfg))


@CPU_ONLY
def test_partial_rotary_is_refused():
    """A rotary width below the head dim pairs rows the programs do not hold together."""
    args = case(1, 2, 1, 64, 4, seed=1)
    args[8] = args[8][:16]
    with pytest.raises(Exception, match="full rotary"):
        QR.qkv_rope_cache_h2(*args, backend="reference", config={"BLOCK_N": 8, "BLOCK_KW": 16, "STAGES": 1})


@CPU_ONLY
@pytest.mark.parametrize("interleaved", [False])
def test_a_llama_whose_qkv_projection_rotates_and_caches_matches_the_plain_path(monkeypatch, interleaved):
    """A tiny random 4-bit llama with 64-dim heads, its GEMVs routed to qmv_h2 as on the GPU: a prefill of
    three tokens and a decode step give the plain path's logits and caches, through the fused projection."""
    import dataclasses
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent.parent / "runtime"))
    from tiny_models import TINY

    from kilnx.dsl.kernel import forget_remembered_configs
    from kilnx.kernels.routing import qmatmul_rows
    from kilnx.models.llama import LlamaModel
    from kilnx.models.loaders.random_init import RandomSource
    from kilnx.models.weights import build_weights
    from kilnx.runtime.kv_cache import KVCache
    monkeypatch.setenv("TRITON_INTERPRET", "0")       # the numba lowering: the interpreter is slow here
    cfg = dataclasses.replace(TINY["llama"], hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64,
                              rope_interleaved=interleaved)
    model = LlamaModel(cfg, build_weights(cfg, RandomSource(cfg, fmt="q4", dtype=torch.float32, seed=4),
                                          dtype=torch.float32, device="cpu"), ops="kilnx")

    def run():
        cache = KVCache.for_model(cfg, 1, 8)
        first = model.forward(torch.tensor([[1, 5, 9]]), torch.arange(3)[None], cache, last=-1)
        second = model.forward(torch.tensor([[7]]), torch.tensor([[3]]), cache)
        return first, second, cache.k[0][:, :, :4], cache.v[1][:, :, :4]

    plain = run()
    monkeypatch.setattr(qmatmul_rows, "choice_for", lambda *a: {"QMV_MAX_ROWS": 8, "GEMV": "qmv_h2"})
    forget_remembered_configs()
    calls = []
    real = QR.qkv_rope_cache
    monkeypatch.setattr(QR, "qkv_rope_cache", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    fused = run()
    assert calls == [(3, 128), (1, 128)]          # prefill and decode of layer 1 (layer 0's x is not prepared)
    for got, want in zip(fused, plain):
        scale = want.float().abs().max().item()
        assert torch.allclose(got.float(), want.float(), rtol=0, atol=3e-2 * scale)


def test_only_projections_it_can_finish_are_served(monkeypatch):
    """Prepared x for a 4/8-bit weight of (Hq + 2 Hk) * D rows, full rotary width, head dims of whole
    64-row blocks; plain activations, partial rotary, a weight of another height are not."""
    from kilnx import ops
    from kilnx.kernels.prepared import PreparedX
    from kilnx.quant import QWeight
    D, Hq, Hk, K = 64, 2, 1, 128
    w = QWeight.from_mlx(torch.zeros((Hq + 2 * Hk) * D, K // 8, dtype=torch.int32), torch.ones((Hq + 2 * Hk) * D, 2),
                         torch.zeros((Hq + 2 * Hk) * D, 2), bits=4, group_size=64)
    x = PreparedX(torch.zeros(1, 4, K // 8, dtype=torch.int32), torch.zeros(1, 2), torch.ones(1, 2), torch.float32)
    inv, cache = torch.ones(D // 2), torch.zeros(1, Hk, 8, D)
    assert ops.fuses_qkv_rope(x, w, inv, cache, Hq)
    assert not ops.fuses_qkv_rope(torch.zeros(1, K), w, inv, cache, Hq)          # plain activations
    assert not ops.fuses_qkv_rope(x, w, inv[:16], cache, Hq)                       # partial rotary
    assert not ops.fuses_qkv_rope(x, w, inv, cache, Hq + 1)                        # not q, k and v of one weight
    monkeypatch.setenv("KILNX_FUSED_QKV_ROPE", "0")
    assert not ops.fuses_qkv_rope(x, w, inv, cache, Hq)


@pytest.mark.gpu
@pytest.mark.parametrize("M,Hq,Hk", [(1, 32, 8), (4, 32, 8), (1, 32, 4)])
def test_fused_qkv_rope_cache_on_the_gpu_equals_the_two_kernel_path(M, Hq, Hk):
    """llama-3.1-8b's (and a 4-KV-head) qkv projection at decode rows, with the GPU's default config."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    args = QR._problem_args({"M": M, "Hq": Hq, "Hk": Hk, "D": 128, "K": 4096}, "cuda")
    args = list(args)
    args[9], args[10] = torch.randn_like(args[9]), torch.randn_like(args[10])
    for interleaved in (False, True):
        cfg = QR._default(*args)
        check(fused(args, Hq, interleaved, None, None), two_kernel_path(args, Hq, interleaved, None, cfg))


@pytest.mark.gpu
def test_a_llama_on_the_gpu_gives_the_same_logits_with_the_fused_projection(monkeypatch):
    """A random 4-bit llama with 64-dim heads on the GPU, prefill then three decode steps: the logits
    with the fused projection (the default) equal those of qmatmul + rope_cache_kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import dataclasses
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent.parent / "runtime"))
    from tiny_models import TINY

    from kilnx.models.llama import LlamaModel
    from kilnx.models.loaders.random_init import RandomSource
    from kilnx.models.weights import build_weights
    from kilnx.runtime.kv_cache import KVCache
    cfg = dataclasses.replace(TINY["llama"], hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64)
    model = LlamaModel(cfg, build_weights(cfg, RandomSource(cfg, fmt="q4", dtype=torch.bfloat16, seed=5),
                                          dtype=torch.bfloat16, device="cuda"), ops="kilnx")
    calls = []
    real = QR.qkv_rope_cache
    monkeypatch.setattr(QR, "qkv_rope_cache", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run():
        cache = KVCache.for_model(cfg, 1, 32, device="cuda", dtype=torch.bfloat16)
        out = [model.forward(torch.tensor([[1, 5, 9]], device="cuda"), torch.arange(3, device="cuda")[None], cache,
                             last=-1)]
        for t in range(3):
            out.append(model.forward(torch.tensor([[7 + t]], device="cuda"), torch.tensor([[3 + t]], device="cuda"),
                                     cache))
        return torch.cat([o.float().reshape(-1) for o in out])

    fused = run()
    assert calls, "the fused projection was not taken"
    monkeypatch.setenv("KILNX_FUSED_QKV_ROPE", "0")
    plain = run()
    torch.testing.assert_close(fused, plain, rtol=2e-2, atol=2e-2 * plain.abs().max().item())
