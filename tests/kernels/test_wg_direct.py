"""qmm_wg_direct (kernels/wg_direct.py): wgmma with the 4-bit weight decoded into its register operand straight
from MLX's layout, K walked in a permuted order that x follows. It gives x @ W.T of MLX's quantized weights on
every backend, for any rows, GPI groups a step and split K; it names the K it cannot take; compiled for sm_90
its loop keeps the weight out of shared memory; qmatmul's route takes it for 4-16 rows on sm_90."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import wg_direct as D
from kilnx.quant import QWeight
from test_qmv_wg import _case, _close, _skip_triton, weight_in_registers_on_sm90  # this folder is on sys.path

BACKENDS = ["reference", "numba", "triton"]


def _bytes(words):
    return words.view(torch.uint8).reshape(words.shape[0], -1)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=4, deadline=None)
@given(shape=st.sampled_from([(64, 128), (128, 512), (64, 384)]), m=st.sampled_from([1, 5, 17, 64, 100]),
       cfg=st.sampled_from([(64, 2, 1), (16, 2, 1), (16, 4, 2), (64, 2, 2), (16, 8, 1), (64, 4, 4), (32, 4, 2)]),
       seed=st.integers(0, 10_000), interleave=st.booleans())
def test_the_gemm_gives_the_product(backend, shape, m, cfg, seed, interleave):
    """Any rows, GPI groups a K step (the largest of 2, 4, 8 up to cfg's that divides K/64), K split over
    programs (the last of a tile's to finish adds the partial sums; in runs, or in turns with INTERLEAVE) or
    not; y in x's dtype either way."""
    _skip_triton(backend)
    words, s, b, x, want = _case(*shape, m, seed)
    block_m, gpi, split = cfg
    gpi = max(d for d in (2, 4, 8) if d <= gpi and (shape[1] // 64) % d == 0)
    done = D.counters_for(x, shape[0])
    got = D.qmm_wg_direct(x, _bytes(words), s, b, done, backend=backend,
                          config={"BLOCK_M": block_m, "GPI": gpi, "SPLIT_K": split, "INTERLEAVE": interleave and split > 1})
    assert got.shape == (m, shape[0]) and got.dtype == x.dtype
    assert _close(got, want)
    assert not done.any()                              # the tile counters are left as found


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m, cfg", [(3, {"BLOCK_M": 16, "GPI": 4, "SPLIT_K": 2}), (20, {"BLOCK_M": 32, "GPI": 2})])
def test_x_given_in_the_kernels_k_order_gives_the_same_product(backend, m, cfg):
    """X_PERMUTED: x arrives permuted along K as the kernel walks it (`permute_k`, a permutation within each
    128-element block) and is read in order; the product is x @ W.T of the unpermuted x."""
    _skip_triton(backend)
    words, s, b, x, want = _case(64, 512, m, 7)
    xp = D.permute_k(x)
    assert not torch.equal(xp, x) and torch.equal(xp.sort(1).values, x.sort(1).values)
    got = D.qmm_wg_direct(xp, _bytes(words), s, b, D.counters_for(x, 64), backend=backend, X_PERMUTED=True,
                          config=cfg)
    assert _close(got, want)


def test_a_step_of_groups_must_divide_k():
    words, s, b, x, _ = _case(64, 384, 3, 0)        # 6 groups: steps of 2, not of 4
    with pytest.raises(Exception, match="GPI 4 groups a step must divide"):
        D.qmm_wg_direct(x, _bytes(words), s, b, D.counters_for(x, 64), backend="reference",
                        config={"BLOCK_M": 16, "GPI": 4})


SM90 = """
import json, sys, torch
sys.path.insert(0, "bench/probes")
from sass_count import operand_facts
from kilnx.codegen.aot import compile_for_target
from kilnx.kernels import wg_direct as D
wb, sg = torch.zeros(256, 2048, dtype=torch.uint8), torch.zeros(256, 64).bfloat16()
done = torch.zeros(4096, dtype=torch.int32)
cases = {"GEMM": (torch.zeros(512, 4096).bfloat16(), {"BLOCK_M": 128, "GPI": 2, "num_stages": 3}),
         "GEMV": (torch.zeros(4, 4096).bfloat16(), {"BLOCK_M": 16, "GPI": 4, "SPLIT_K": 4, "num_stages": 3}),
         "GEMV_INTERLEAVED": (torch.zeros(4, 4096).bfloat16(),
                              {"BLOCK_M": 16, "GPI": 4, "SPLIT_K": 4, "INTERLEAVE": True, "num_stages": 3})}
facts = {name: operand_facts(compile_for_target(D.qmm_wg_direct, (x, wb, sg, sg, done), cfg, aligned=True))
         for name, (x, cfg) in cases.items()}
facts["GEMV_X_PERMUTED"] = operand_facts(compile_for_target(
    D.qmm_wg_direct, (torch.zeros(4, 4096).bfloat16(), wb, sg, sg, done),
    {"BLOCK_M": 16, "GPI": 4, "SPLIT_K": 4, "num_stages": 3}, aligned=True, kw={"X_PERMUTED": True}))
print(json.dumps(facts))
"""


def test_the_weight_reaches_wgmma_in_registers_for_sm90():
    """The pipelined loop stores nothing to shared memory (cp.async stages the bytes, the scales and x; a
    decoded weight going through shared memory would take 16-byte stores a thread), with one wgmma
    m64n16k16 a 16 codes of the step (4 groups: 16)."""
    facts = weight_in_registers_on_sm90(SM90)
    assert facts["GEMV"]["loop_ops"]["HGMMA"] == 16
    # x in the kernel's K order: its 4-byte gathers become wider copies, fewer cp.async a step
    assert facts["GEMV_X_PERMUTED"]["loop_ops"]["LDGSTS"] < facts["GEMV"]["loop_ops"]["LDGSTS"]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 64, 300])
def test_the_gemm_gives_the_product_on_the_gpu(m):
    words, s, b, x, want = _case(256, 512, m, 7)
    args = [t.cuda() for t in (_bytes(words), s, b)]
    done = D.counters_for(x.cuda(), 256)
    for cfg in ({"BLOCK_M": 64, "GPI": 2, "num_stages": 2}, {"BLOCK_M": 128, "GPI": 2, "num_stages": 3},
                {"BLOCK_M": 256, "GPI": 2, "num_stages": 2}, {"BLOCK_M": 16, "GPI": 8, "SPLIT_K": 1, "num_stages": 3},
                {"BLOCK_M": 16, "GPI": 4, "SPLIT_K": 2}, {"BLOCK_M": 64, "GPI": 2, "SPLIT_K": 4, "num_stages": 1},
                {"BLOCK_M": 16, "GPI": 4, "SPLIT_K": 4, "INTERLEAVE": True, "num_stages": 3}):
        assert _close(D.qmm_wg_direct(x.cuda(), *args, done, config=cfg).cpu(), want), cfg
        assert not done.any(), cfg


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel runs on the CPU only "
                    "under the Triton interpreter")
def test_the_route_serves_wg_min_rows_to_sixteen_rows_with_it(monkeypatch):
    """qmatmul's route (kernels/routing.py) takes qmm_wg_direct from WG_MIN_ROWS up to 16 rows of a weight it
    takes, without a second copy of the weight; KILNX_WG=0 turns it off (an A/B switch)."""
    from kilnx.kernels.routing import WG_NEVER, qmatmul_rows
    words, s, b, x, want = _case(128, 256, 70, 3)
    calls = []
    real = D.qmm_wg_direct
    monkeypatch.setattr(D, "qmm_wg_direct", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    chosen = {**qmatmul_rows.space.default(), "WG_MIN_ROWS": 4, "TC_MIN_ROWS": 8}
    for m in (1, 2, 4, 16, 17, 70):
        assert _close(qmatmul_rows.serve(x[:m], words, s, b, chosen, backend="triton"), want[:m]), m
    assert calls == [4, 16]
    odd = _case(64, 192, 4, 1)                                              # K/64 odd: not taken
    qmatmul_rows.serve(odd[3], *odd[:3], chosen, backend="triton")
    served = qmatmul_rows.server_of_path("qmm_wg_direct", x[:40], words, s, b, backend="triton")
    assert _close(served(x[:40], words, s, b), want[:40])
    assert calls == [4, 16, 40]                                             # the kernel serves up to 64 rows
    never = {**chosen, "WG_MIN_ROWS": WG_NEVER}
    qmatmul_rows.serve(x[:8], words, s, b, never, backend="triton")
    assert calls == [4, 16, 40]
    calls.clear()
    monkeypatch.setenv("KILNX_WG", "0")
    qmatmul_rows.serve(x[:8], words, s, b, chosen, backend="triton")
    assert calls == []


@pytest.mark.gpu
def test_qmatmul_takes_it_by_default_on_the_gpu(monkeypatch):
    from kilnx.kernels import qmatmul as qm
    from kilnx.kernels import routing  # noqa: F401 - the route hashes the real kernel's source: built before the patch
    words, s, b, x, want = _case(256, 512, 300, 9)
    calls = []
    real = D.qmm_wg_direct
    monkeypatch.setattr(D, "qmm_wg_direct", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    w = QWeight.from_mlx(words.cuda(), s.cuda(), b.cuda(), bits=4, group_size=64)
    for m in (1, 4, 16, 17, 300):
        y = qm.qmatmul(x[:m].cuda(), w)
        assert y.dtype == x.dtype and _close(y.cpu(), want[:m]), m
    assert calls == [4, 16]


@pytest.mark.parametrize("m", [5, 70])
def test_tuning_inputs_pass_the_kernels_own_gate(m):
    """What `kilnx tune --kernel qmm_wg_direct` builds (scaled down): the spec, the tolerance and the cuBLAS
    peer agree with the kernel's output; the kernel is in the registry the tuner reads."""
    from kilnx.kernels import registry
    kernel = registry.get("qmm_wg_direct")
    problem = {"M": m, "N": 128, "K": 256}
    args = kernel.make_args(problem, "cpu")
    got = kernel(*args, backend="reference", config={})
    rtol, atol = kernel.tolerance(args)
    assert torch.allclose(got.float(), kernel.reference(*args).float(), rtol=rtol, atol=atol)
    assert torch.allclose(got.float(), kernel.peer(*args).float(), rtol=rtol, atol=atol)
    assert kernel.key(*args) == f"M={m},N=128,K=256"


@pytest.mark.parametrize("n,k,want", [(6144, 4096, (4, 4, 1)), (4096, 4096, (8, 4, 1)), (28672, 4096, (4, 1, 3)),
                                      (4096, 14336, (8, 4, 1))])
def test_the_default_is_what_the_h200_measured_best_at_four_rows(monkeypatch, n, k, want):
    """llama-3.1-8b's qkv / o / gate_up / down on 132 SMs: (GPI, SPLIT_K, stages) of the best of 16 settings
    (bench/results/2026-12-05_h200_qmv_direct_sweep_s21.csv); the rules in _default give them."""
    from kilnx.kernels import dense_mm
    monkeypatch.setattr(dense_mm, "sm_count", lambda t: 132)
    args = (torch.zeros(4, k).bfloat16(), torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 64).bfloat16(),
            torch.zeros(n, k // 64).bfloat16(), torch.zeros(1, dtype=torch.int32))
    cfg = D.qmm_wg_direct.default_config(*args)
    assert (cfg["GPI"], cfg["SPLIT_K"], cfg["num_stages"], cfg["BLOCK_M"]) == (*want, 16)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the route takes it on the GPU or under the "
                    "Triton interpreter")
def test_producers_emit_plain_activations_where_the_route_takes_it(monkeypatch):
    """A norm or SwiGLU before a GEMV emits qmv_h2's prepared activations only where qmv_h2 will take them:
    rows the route sends to qmm_wg_direct get plain ones (B = 4 decode ran qmv_h2 through the prepared
    path whatever the route said, before this)."""
    from kilnx.kernels import prepared
    from kilnx.kernels.routing import WG_NEVER, qmatmul_rows
    words, s, b, x, _ = _case(128, 256, 4, 5)
    w = QWeight.from_mlx(words, s, b, bits=4, group_size=64)
    for wg_rows, want in ((4, None), (WG_NEVER, (8, 64))):
        chosen = {"QMV_MAX_ROWS": 8, "GEMV": "qmv_h2", "TC_MIN_ROWS": 65, "WG_MIN_ROWS": wg_rows}
        monkeypatch.setattr(qmatmul_rows, "choice_for", lambda *a, chosen=chosen: chosen)
        assert prepared._prepared_format([w], x) == want, wg_rows


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                    reason="a CPU test (numba kernels)")
def test_a_batched_decode_step_through_the_route_gives_the_plain_logits(monkeypatch):
    """A 4-row decode step of a small bf16 4-bit llama whose shapes qmm_wg_direct takes: with the route on,
    every projection goes to it and the norms and SwiGLU emit plain activations (the fused qkv + rope kernel,
    which takes prepared ones, steps aside); the logits are those of the qmv_h2 route."""
    from kilnx.kernels import prepared
    from kilnx.kernels.routing import WG_NEVER, qmatmul_rows
    from kilnx.models.config import ModelConfig
    from kilnx.models.llama import LlamaModel
    from kilnx.models.loaders.random_init import RandomSource
    from kilnx.models.weights import build_weights
    from kilnx.runtime.kv_cache import KVCache
    monkeypatch.setenv("TRITON_INTERPRET", "0")       # the numba lowering: the interpreter is slow here
    cfg = ModelConfig(arch="llama", vocab_size=256, hidden_size=128, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
                      tie_embeddings=False, max_position_embeddings=64)
    src = RandomSource(cfg, fmt="q4", dtype=torch.bfloat16, seed=2)
    model = LlamaModel(cfg, build_weights(cfg, src, dtype=torch.bfloat16, device="cpu"), ops="kilnx")
    ids, pos = torch.tensor([[3], [7], [11], [200]]), torch.tensor([[0], [1], [2], [3]])
    calls, made = [], []
    real = D.qmm_wg_direct
    monkeypatch.setattr(D, "qmm_wg_direct", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    for name in ("add_rms_norm_prepared", "silu_mul_prepared"):
        fn = getattr(prepared, name)
        monkeypatch.setattr(prepared, name, lambda *a, fn=fn, name=name, **k: made.append(name) or fn(*a, **k))
    from kilnx.dsl.kernel import forget_remembered_configs

    def step(wg_rows):
        chosen = {"QMV_MAX_ROWS": 8, "GEMV": "qmv_h2", "TC_MIN_ROWS": 65, "WG_MIN_ROWS": wg_rows}
        monkeypatch.setattr(qmatmul_rows, "choice_for", lambda *a: chosen)
        forget_remembered_configs()
        from kilnx.kernels import qmatmul
        qmatmul._SERVED.clear()
        return model.forward(ids, pos, KVCache.for_model(cfg, 4, 8, dtype=torch.bfloat16), last=-1)

    plain = step(WG_NEVER)
    assert calls == [] and made                      # qmv_h2 with prepared activations
    made.clear()
    routed = step(4)
    # qkv (192 rows), o and down (128), gate_up (256) of both layers, and the lm_head (256)
    assert made == [] and sorted(calls) == [128] * 4 + [192] * 2 + [256] * 3
    scale = plain.float().abs().max().item()
    assert torch.allclose(routed.float(), plain.float(), rtol=0, atol=3e-2 * scale)
