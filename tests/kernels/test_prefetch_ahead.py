"""Ahead programs (kernels/_gemv.py, KILNX_PREFETCH_AHEAD): the small kernels before a GEMV (the residual norm, the
SwiGLU, the attention merge) with extra programs that ask L2 for the head of that GEMV's weight. They change no
value: every output equals the kernel's without them, on every backend (the reference checks that every prefetched
index lies inside its tensor, so a row or line past the weight fails there); the prefetches all come before the
grid sync; and the prepared format names the weight to ask for without keeping it alive."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from kilnx.kernels import _gemv as G
from kilnx.kernels import attention as A
from kilnx.kernels import attention_split as AS
from kilnx.kernels import prepared
from kilnx.quant import QWeight

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                reason="the CPU tests run Triton kernels under TRITON_INTERPRET=1")
BACKENDS = ["triton", "numba", "reference"]


def _weight(n: int, k: int) -> QWeight:
    w = QWeight.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(n)), bits=4, group_size=64)
    return QWeight.from_mlx(w.packed, w.scales.bfloat16(), w.biases.bfloat16(), bits=4, group_size=64)


def _ahead(w: QWeight, rows: int) -> tuple[tuple, dict]:
    """The ahead tensors and scalars for `rows` rows of w: 45 rows is one whole program of AHEAD_ROWS and a part."""
    return ((w.packed, w.scales, w.biases),
            {"AHEAD": True, "ahead_rows": rows, "WORD_LINES": G.ahead_lines(w.packed),
             "GROUP_LINES": G.ahead_lines(w.scales)})


def _same(got, want):
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,rows", [(96, 45), (40, 40)])
def test_the_norm_with_ahead_programs_gives_the_same_outputs(backend, n, rows):
    """An (n, 1024) weight ahead (its words span 4 lines a row, its 16 groups' scales one): its first 45 of 96 rows,
    or all 40 (the second program's rows past the weight are clamped into it)."""
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(2, 192, generator=g).bfloat16(), torch.randn(2, 192, generator=g).bfloat16()
    w = (torch.rand(192, generator=g) + 0.5).bfloat16()
    kw = dict(eps=1e-5, offset=0.0, PER=8, GROUP=64, backend=backend)
    tensors, scalars = _ahead(_weight(n, 1024), rows)
    _same(prepared.add_rms_norm_prep(x, res, w, *tensors, **scalars, **kw),
          prepared.add_rms_norm_prep(x, res, w, x, x, x, **kw))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_swiglu_with_ahead_programs_gives_the_same_outputs(backend):
    """Two row blocks a row (F = 448 over BLOCK_KW 32 x 8 codes), then the ahead programs on the same axis."""
    gate_up = (torch.randn(2, 2 * 448, generator=torch.Generator().manual_seed(4)) * 2).bfloat16()
    kw = dict(PER=8, GROUP=64, backend=backend, config={"BLOCK_KW": 32})
    tensors, scalars = _ahead(_weight(40, 1024), 40)
    _same(prepared.silu_mul_prep(gate_up, *tensors, **scalars, **kw),
          prepared.silu_mul_prep(gate_up, gate_up, gate_up, gate_up, **kw))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_attention_merge_with_ahead_programs_gives_the_same_outputs(backend):
    g = torch.Generator().manual_seed(5)
    D = 64
    q = torch.randn(2, 1, 4, D, generator=g).bfloat16()
    k_cache, v_cache = (torch.randn(2, 2, 160, D, generator=g).bfloat16() for _ in range(2))
    positions = torch.tensor([[150], [20]])
    kw = A._kernel_kwargs(q, k_cache, D ** -0.5, None, None)
    parts = AS.attention_split_kernel(q, k_cache, v_cache, positions, config={"BLOCK_M": 16, "BLOCK_N": 16,
                                                                            "KEYS_PER_SPLIT": 32}, backend="reference", **kw)
    tensors, scalars = _ahead(_weight(96, 1024), 45)
    _same(AS.attention_merge_prep(*parts, q, *tensors, PER=8, GROUP=64, backend=backend, **scalars),
          AS.attention_merge_prep(*parts, q, q, q, q, PER=8, GROUP=64, backend=backend))


def test_the_ahead_prefetches_come_before_the_grid_sync():
    x = torch.randn(2, 192).bfloat16()
    tensors, scalars = _ahead(_weight(96, 1024), 45)
    src = prepared.add_rms_norm_prep.triton_source(x, x, x[0], *tensors, eps=1e-5, offset=0.0, PER=8, GROUP=64,
                                                   **scalars)
    body = src.split("):\n", 1)[1]
    sync = body.index("_rt.grid_dependency_sync()")
    # words, scales, biases: each one prefetch in its loop over the rows' lines, all before the sync and any load
    assert body[:sync].count("_rt.prefetch_l2(") == 3 and "_rt.prefetch_l2(" not in body[sync:]
    assert "tl.load(" not in body[:sync]


def test_the_prepared_format_names_its_weight_without_keeping_it(monkeypatch):
    """One 2-D weight: the format is (PER, GROUP) and names it as `ahead`; the memo of formats holds it weakly."""
    from kilnx.kernels.routing import qmatmul_rows
    monkeypatch.setattr(qmatmul_rows, "path", lambda *a, **k: "qmv_h2")
    w = _weight(64, 128)
    fmt = prepared.prepared_format([w], torch.zeros(1, 128))
    assert fmt == (8, 64) and fmt.ahead is w
    assert prepared.prepared_format([w, _weight(32, 128)], torch.zeros(1, 128)).ahead is None   # parts kept apart
    del w
    gc.collect()
    assert fmt.ahead is None


def test_the_switch_reads_megabytes_only_with_pdl(monkeypatch):
    from kilnx.codegen import triton_rt
    w = _weight(96, 1024)     # a row: 512 bytes of words, 2 x 32 of scales and biases
    assert G.ahead_rows(w, 10 * 576) == 10 and G.ahead_rows(w, 1 << 30) == 96
    for value, pdl, want in [("0", True, 0), ("0.5", True, 1 << 19), ("8", False, 0)]:
        monkeypatch.setenv("KILNX_PREFETCH_AHEAD", value)
        monkeypatch.setattr(triton_rt, "pdl_enabled", lambda pdl=pdl: pdl)
        G.ahead_bytes.cache_clear()
        assert G.ahead_bytes() == want
    monkeypatch.setenv("KILNX_PREFETCH_AHEAD", "lots")
    G.ahead_bytes.cache_clear()
    with pytest.raises(ValueError, match="KILNX_PREFETCH_AHEAD='lots'.*megabytes"):
        G.ahead_bytes()
    G.ahead_bytes.cache_clear()
    # off the GPU the producers take no ahead programs, whatever the switch says
    monkeypatch.setenv("KILNX_PREFETCH_AHEAD", "8")
    monkeypatch.setattr(triton_rt, "pdl_enabled", lambda: True)
    x = torch.zeros(1, 128)
    assert G.ahead_args(prepared.PreparedFormat(8, 64, w), x) == ((x, x, x), {"ahead_rows": 0, "AHEAD": False,
                                                                              "WORD_LINES": 1, "GROUP_LINES": 1})
    G.ahead_bytes.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_decode_with_ahead_programs_gives_the_same_logits_on_gpu(monkeypatch):
    """A random tiny llama's graph-replayed decode steps, with and without KILNX_PREFETCH_AHEAD: the same bits."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
    from test_engine_gpu import model

    from kilnx.runtime.engine import Engine
    prompt = list(range(3, 40))
    got = {}
    for mb in ("0", "8"):
        monkeypatch.setenv("KILNX_PREFETCH_AHEAD", mb)
        G.ahead_bytes.cache_clear()
        engine = Engine(model("llama", "kilnx"), max_seq=512, cuda_graphs=True)
        logits = [engine.prefill(prompt).float()]
        for step in range(4):
            tok = torch.tensor([int(logits[-1].argmax())], device="cuda")
            logits.append(engine.decode(tok, torch.tensor([len(prompt) + step], device="cuda"))[0].float())
        got[mb] = torch.stack([x.reshape(-1) for x in logits])
    G.ahead_bytes.cache_clear()
    assert torch.equal(got["8"], got["0"])
