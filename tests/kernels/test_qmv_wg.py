"""The wgmma kernel with the weight in the operand layout (kernels/qmv_wg.py): the packing puts every code
where the module says and back; qmm_wg (any rows, GPI groups a K step, split over K or not) gives x @ W.T of
MLX's quantized weights on every backend; compiled for sm_90 its loop keeps the weight out of shared memory;
qmatmul's route takes it for its wgmma rows of large weights, on a copy made where memory allows."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kilnx.kernels import qmv_wg as W
from kilnx.quant import QWeight

BACKENDS = ["reference", "numba", "triton"]


def _skip_triton(backend):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels run on CPU only under TRITON_INTERPRET=1")


def _case(n, k, m, seed):
    """MLX-quantized weights in MLX's layout, x, and the product's meaning x @ dequantize().T (fp32). MLX quantizes
    where it is installed; elsewhere (the GPU machine) kilnx's quantizer, bit-exact with it (tests/quant)."""
    rng = np.random.default_rng(seed)
    w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05).bfloat16()
    try:
        import mlx.core as mx
    except ImportError:
        q = QWeight.quantize(w, bits=4, group_size=64)
        words, s, b = q.packed.view(torch.uint32), q.scales, q.biases
    else:
        wq, s, b = mx.quantize(mx.array(w.float().numpy()).astype(mx.bfloat16), group_size=64, bits=4)
        words = torch.from_numpy(np.array(wq).view(np.int32)).view(torch.uint32)
        s, b = (torch.from_numpy(np.array(v.astype(mx.float32))).bfloat16() for v in (s, b))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).bfloat16()
    dense = QWeight.from_mlx(words, s, b, bits=4, group_size=64).dequantize().float()
    return words, s, b, x, x.float() @ dense.t()

def _close(got, want):
    """Within the output's bf16 rounding of the fp32 product (an ulp: the interpreter's conversion truncates)."""
    return torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_the_packing_places_each_code_as_documented_and_unpacks_exactly():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (128, 128), generator=g)
    words = torch.zeros(128, 16, dtype=torch.int64)
    for j in range(8):
        words |= codes[:, j::8] << (4 * j)
    wb = W.pack_operand(words.to(torch.int32).view(torch.uint32))
    assert wb.shape == (2, 2, 2048) and torch.equal(W.unpack_operand(wb).long(), codes)
    for pb, grp, e in [(0, 0, 0), (1, 1, 2047), (0, 1, 777), (1, 0, 1234), (1, 1, 513)]:
        o, lane, warp = e % 16, e // 16 % 32, e // 512
        row, col = pb * 64 + 16 * warp + 8 * (o % 2) + lane // 4, lane % 4 + 4 * (o // 2)
        byte = int(wb[pb, grp, e])
        assert (byte & 15, byte >> 4) == (codes[row, grp * 64 + 2 * col], codes[row, grp * 64 + 2 * col + 1])
    two = W.pack_operand(words.to(torch.int32).view(torch.uint32), wg=2)   # two warpgroups: warps 4..7, rows 64..127
    assert two.shape == (1, 2, 4096) and int(two[0, 1, 2048 + 5 * 16]) == int(wb[1, 1, 5 * 16])


def test_the_packing_names_what_it_cannot_take():
    with pytest.raises(ValueError, match="multiples of 64"):
        W.pack_operand(torch.zeros(100, 16, dtype=torch.uint32))
    with pytest.raises(ValueError, match="MLX 4-bit words"):
        W.pack_operand(torch.zeros(64, 16, dtype=torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=4, deadline=None)
@given(shape=st.sampled_from([(64, 64), (128, 512), (64, 384)]), m=st.sampled_from([1, 5, 17, 64, 100]),
       cfg=st.sampled_from([(64, 1, 1), (16, 2, 1), (16, 4, 2), (64, 2, 2), (16, 8, 1), (64, 1, 4)]),
       seed=st.integers(0, 10_000))
def test_the_gemm_gives_the_product(backend, shape, m, cfg, seed):
    """Any rows (16 a program serves the GEMV's sizes), GPI groups a K step where they divide K/64, K split
    over programs (fp32 out) or not (x's dtype)."""
    _skip_triton(backend)
    words, s, b, x, want = _case(*shape, m, seed)
    block_m, gpi, split = cfg
    gpi = max(d for d in (1, 2, 4, 8) if d <= gpi and (shape[1] // 64) % d == 0)
    got = W.qmm_wg(x, W.flat(W.pack_operand(words)), W.group_major(s), W.group_major(b), backend=backend,
                   config={"BLOCK_M": block_m, "GPI": gpi, "SPLIT_K": split})
    assert got.shape == (m, shape[0]) and got.dtype == (x.dtype if split == 1 else torch.float32)
    assert _close(got, want)


def test_a_step_of_groups_must_divide_k():
    words, s, b, x, _ = _case(64, 384, 3, 0)        # 6 groups: steps of 2, not of 4
    with pytest.raises(Exception, match="GPI 4 groups a step must divide"):
        W.qmm_wg(x, W.flat(W.pack_operand(words)), W.group_major(s), W.group_major(b), backend="reference",
                 config={"BLOCK_M": 16, "GPI": 4})


SM90 = """
import json, sys, torch
sys.path.insert(0, "bench/probes")
from sass_count import operand_facts
from kilnx.codegen.aot import compile_for_target
from kilnx.kernels import qmv_wg as W
wb, sg = torch.zeros(4, 64, 2048, dtype=torch.uint8), torch.zeros(4, 64, 64).bfloat16()
cases = {"qmm_wg": (W.qmm_wg, (torch.zeros(512, 4096).bfloat16(), W.flat(wb), sg, sg), {"BLOCK_M": 128, "num_stages": 3}),
         "qmm_wg GEMV": (W.qmm_wg, (torch.zeros(4, 4096).bfloat16(), W.flat(wb), sg, sg),
                         {"BLOCK_M": 16, "GPI": 8, "SPLIT_K": 4, "num_stages": 3})}
print(json.dumps({name: operand_facts(compile_for_target(kernel, args, cfg, aligned=True))
                  for name, (kernel, args, cfg) in cases.items()}))
"""


def weight_in_registers_on_sm90(script: str) -> dict:
    """Runs `script` (it prints operand_facts by case, compiled for sm_90 without a GPU) in a process of its
    own (the Triton compiler, not the interpreter) and asserts of every case: the A operand a register tensor,
    wgmma in the main loop, no shared-memory store in it. Returns the facts."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    for name, f in facts.items():
        stores = f["loop_ops"].get("STS", 0) + f["loop_ops"].get("STSM", 0)
        assert f["a_in_registers"] and f["loop_ops"].get("HGMMA", 0) >= 4, (name, f)
        assert stores == 0, (name, f["loop_ops"])
    return facts


def test_the_weight_reaches_wgmma_in_registers_for_sm90():
    """qmm_wg's pipelined loop stores nothing to shared memory (cp.async brings x and the bytes; the decoded
    weight would take four or more 16-byte stores a thread), at 128 rows a program and at the GEMV's shape."""
    facts = weight_in_registers_on_sm90(SM90)
    assert facts["qmm_wg GEMV"]["loop_ops"]["HGMMA"] == 32          # 8 groups a step, one m64n16k16 per 16 codes


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 64, 300])
def test_the_gemm_gives_the_product_on_the_gpu(m):
    words, s, b, x, want = _case(256, 512, m, 7)
    args = [t.cuda() for t in (W.pack_operand(words), W.group_major(s), W.group_major(b))]
    for cfg in ({"BLOCK_M": 64, "num_stages": 2}, {"BLOCK_M": 128, "num_stages": 3}, {"BLOCK_M": 256, "num_stages": 3},
                {"BLOCK_M": 16, "GPI": 8, "SPLIT_K": 1, "num_stages": 3}, {"BLOCK_M": 16, "GPI": 4, "SPLIT_K": 2},
                {"BLOCK_M": 64, "GPI": 2, "SPLIT_K": 4, "num_stages": 1}):
        assert _close(W.qmm_wg(x.cuda(), W.flat(args[0]), *args[1:], config=cfg).cpu(), want), cfg


def _counting(monkeypatch, module, name):
    """Patches module.name to record the rows of each call (its first argument) in the returned list."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    return calls


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel runs on the CPU only "
                    "under the Triton interpreter")
def test_the_route_serves_its_wgmma_rows_from_a_repacked_copy_where_chosen(monkeypatch):
    """With WG_REPACKED the route's wgmma rows (WG_MIN_ROWS-16) take qmm_wg on the operand layout, packed once
    per weight and dropped with it; without, qmm_wg_direct on MLX's layout. KILNX_WG=1 / direct overrule the
    choice for A/Bs, and where memory does not allow a copy the direct kernel serves."""
    from kilnx.kernels import wg_direct as D
    from kilnx.kernels.routing import qmatmul_rows
    monkeypatch.delenv("KILNX_WG", raising=False)
    words, s, b, x, want = _case(128, 256, 70, 3)
    repacked, direct = _counting(monkeypatch, W, "qmm_wg"), _counting(monkeypatch, D, "qmm_wg_direct")
    chosen = {**qmatmul_rows.space.default(), "WG_MIN_ROWS": 4, "WG_REPACKED": True}
    for m in (1, 2, 4, 16, 17):
        y = qmatmul_rows.serve(x[:m], words, s, b, chosen, backend="triton")
        assert y.dtype == x.dtype and _close(y, want[:m]), m
    assert repacked == [4, 16] and direct == []
    op = W.operand_for(words, s, b)
    assert op[0].shape == (2, 4 * 2048) and W.operand_for(words, s, b) is op        # packed once, kept
    qmatmul_rows.serve(x[:4], words, s, b, {**chosen, "WG_REPACKED": False}, backend="triton")
    assert direct == [4]
    monkeypatch.setenv("KILNX_WG", "direct")
    qmatmul_rows.serve(x[:4], words, s, b, chosen, backend="triton")
    monkeypatch.setenv("KILNX_WG", "1")
    assert _close(qmatmul_rows.serve(x[:5], words, s, b, {**chosen, "WG_REPACKED": False}, backend="triton"), want[:5])
    assert direct == [4, 4] and repacked == [4, 16, 5]
    monkeypatch.setenv("KILNX_WG", "0")
    qmatmul_rows.serve(x[:5], words, s, b, chosen, backend="triton")
    assert direct == [4, 4] and repacked == [4, 16, 5]                            # off: qmv_h2's route
    monkeypatch.delenv("KILNX_WG")
    other = _case(128, 256, 4, 5)
    monkeypatch.setattr(W, "memory_allows", lambda *a: False)
    assert _close(qmatmul_rows.serve(other[3], *other[:3], chosen, backend="triton"), other[4])
    assert direct == [4, 4, 4] and W.operand_for(*other[:3]) is None            # no room: MLX's layout serves
    n = len(W._OPERANDS._store)
    del words, op
    assert len(W._OPERANDS._store) == n - 1                                             # the copy goes with its weight


def test_the_default_gives_large_weights_the_copy():
    """Gate_up and down of llama-3.1-8b get the repacked copy, qkv and o not (REPACK_MIN_BYTES); the CPU's
    default never takes the wgmma kernels."""
    from kilnx.kernels.routing import WG_NEVER, qmatmul_rows
    words = {name: torch.empty(n, k // 8, dtype=torch.uint32, device="meta")
             for name, n, k in [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]}
    assert {name: W.repack_pays(w) for name, w in words.items()} == {"qkv": False, "o": False, "gate_up": True,
                                                                     "down": True}
    x, w = torch.zeros(1, 128).bfloat16(), torch.zeros(64, 16, dtype=torch.uint32)
    assert qmatmul_rows.default_config(x, w, torch.zeros(64, 2).bfloat16(), None)["WG_MIN_ROWS"] == WG_NEVER


@pytest.mark.gpu
def test_the_route_serves_from_the_copy_on_the_gpu(monkeypatch):
    """On the GPU: the default gives a large weight the copy; qmatmul's wgmma rows then take qmm_wg; with no
    memory to spare (the reserve set to the whole device) the direct kernel serves and nothing is packed."""
    from kilnx.dsl.kernel import forget_remembered_configs
    from kilnx.kernels import qmatmul as qm
    from kilnx.kernels import routing
    from kilnx.kernels import wg_direct as D
    monkeypatch.delenv("KILNX_WG", raising=False)
    big = torch.empty(28672, 512, dtype=torch.uint32, device="cuda")
    assert routing.qmatmul_rows.default_config(torch.zeros(1, 4096, device="cuda").bfloat16(), big,
                                               torch.empty(28672, 64, device="cuda").bfloat16(), None)["WG_REPACKED"]
    words, s, b, x, want = _case(256, 512, 300, 9)
    words, s, b = words.cuda(), s.cuda(), b.cuda()
    monkeypatch.setattr(W, "REPACK_MIN_BYTES", 0)
    repacked, direct = _counting(monkeypatch, W, "qmm_wg"), _counting(monkeypatch, D, "qmm_wg_direct")
    w = QWeight.from_mlx(words, s, b, bits=4, group_size=64)
    forget_remembered_configs()                         # the route's memo of choices: asked afresh
    for m in (1, 4, 16, 17, 300):
        y = qm.qmatmul(x[:m].cuda(), w)
        assert y.dtype == x.dtype and _close(y.cpu(), want[:m]), m
    assert repacked == [4, 16] and direct == [] and W.operand_for(w.packed, w.scales, w.biases) is not None
    monkeypatch.setattr(W, "RESERVE_FRACTION", 1.0)
    w2 = QWeight.from_mlx(words.clone(), s, b, bits=4, group_size=64)
    assert _close(qm.qmatmul(x[:4].cuda(), w2).cpu(), want[:4])
    assert direct == [4] and W.operand_for(w2.packed, w2.scales, w2.biases) is None


@pytest.mark.parametrize("m", [5, 70])
def test_tuning_inputs_pass_the_kernels_own_gate(m):
    """What `kilnx tune --kernel qmm_wg` builds (scaled down): the spec, the tolerance and the cuBLAS peer agree
    with the kernel's output at the GEMV's sizes and more; the kernel is in the registry the tuner reads."""
    from kilnx.kernels import registry
    kernel = registry.get("qmm_wg")
    problem = {"M": m, "N": 128, "K": 128}
    args = kernel.make_args(problem, "cpu")
    got = kernel(*args, backend="reference", config={})
    rtol, atol = kernel.tolerance(args)
    assert torch.allclose(got.float(), kernel.reference(*args).float(), rtol=rtol, atol=atol)
    assert torch.allclose(got.float(), kernel.peer(*args).float(), rtol=rtol, atol=atol)
    assert kernel.key(*args) == f"M={problem['M']},N=128,K=128"
