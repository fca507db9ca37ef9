"""The qmv/qmm crossover is a tuned, stored choice: the route serves each row count with the kernel
its choice names, the tuner can measure it like a kernel, and the runtime reads it from the DB."""

from __future__ import annotations

import os

import pytest
import torch

from kilnx.cache import TuningDB
from kilnx.kernels import qmatmul as Q
from kilnx.kernels.routing import (NARROW_TILE_MAX_ROWS, TC_NEVER, WG_NEVER, QmatmulRowsRoute, qmatmul_rows,
                                   takes_dequant_mm, two_kernels_win)
from kilnx.runtime import dispatch
from kilnx.runtime.device import cpu_info

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")
PROBLEM = {"N": 24, "K": 128, "bits": 4, "gs": 64}
# the same route over a shorter sweep, for a tune that fits in a test (workers import it by this name)
short_route = QmatmulRowsRoute()
short_route.ROWS = (1, 2)


@pytest.mark.parametrize("limit,gemv,tc", [(0, "qmv", TC_NEVER), (2, "qmv", TC_NEVER), (16, "qmv", TC_NEVER),
                                           (4, "qmv_h2", TC_NEVER), (16, "qmv_h2", 2)])
def test_every_choice_gives_the_reference_sweep(limit, gemv, tc):
    args = qmatmul_rows.make_args(PROBLEM, "cpu")
    got = qmatmul_rows.compile({"QMV_MAX_ROWS": limit, "GEMV": gemv, "TC_MIN_ROWS": tc}, *args, backend="triton")(*args)
    want = qmatmul_rows.reference(*args)
    assert got.shape == (sum(qmatmul_rows.ROWS), 24)
    rtol, atol = qmatmul_rows.tolerance(args)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def test_rows_up_to_the_limit_take_the_gemv(monkeypatch):
    from kilnx.kernels import qmv_h2 as H
    used = []

    def spy(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: used.append(name) or real(*a, **k))
    spy(Q, "qmv"), spy(H, "qmv_h2"), spy(Q, "qmm")
    x, wq, s, b = qmatmul_rows.make_args(PROBLEM, "cpu")
    want = Q._dense_spec(x[:5], wq, s, b, 4, 64)
    for gemv in ("qmv", "qmv_h2"):
        for m in (1, 4, 5):
            y = qmatmul_rows.serve(x[:m], wq, s, b, {"QMV_MAX_ROWS": 4, "GEMV": gemv}, backend="reference")
            torch.testing.assert_close(y.float(), want[:m].float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert used == ["qmv", "qmv", "qmm", "qmv_h2", "qmv_h2", "qmm"]


def test_rows_from_the_tensor_core_limit_take_qmv_tc(monkeypatch):
    from kilnx.kernels import qmv_h2 as H, qmv_tc as T
    used = []
    for module, name in ((H, "qmv_h2"), (T, "qmv_tc"), (Q, "qmm")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **k: used.append(name) or real(*a, **k))
    x, wq, s, b = qmatmul_rows.make_args(PROBLEM, "cpu")
    for m in (1, 4, 5, 16):
        qmatmul_rows.serve(x[:m], wq, s, b, {"QMV_MAX_ROWS": 4, "GEMV": "qmv_h2", "TC_MIN_ROWS": 5}, backend="reference")
    # fp32 activations are not qmv_tc's: they keep the GEMV / tile GEMM
    qmatmul_rows.serve(x[:5].float(), wq, s, b, {"QMV_MAX_ROWS": 4, "GEMV": "qmv_h2", "TC_MIN_ROWS": 5},
                       backend="reference")
    assert used == ["qmv_h2", "qmv_h2", "qmv_tc", "qmv_tc", "qmm"]


def test_the_stored_choice_is_what_the_runtime_reads(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/tuned.db"
    monkeypatch.setenv("KILNX_DB", url)
    dispatch.reset()
    args = qmatmul_rows.make_args(PROBLEM, "cpu")
    # nothing tuned: the device's default (on the CPU, up to 32 rows through the row-interleaved GEMV)
    assert qmatmul_rows.choice_for(*args) == {"QMV_MAX_ROWS": 32, "GEMV": "qmv_il", "TC_MIN_ROWS": TC_NEVER,
                                              "WG_MIN_ROWS": WG_NEVER, "WG_REPACKED": False}
    with TuningDB(url) as db:
        db.record_result(kernel=qmatmul_rows.name, source_hash=qmatmul_rows.source_hash, device=cpu_info(),
                         bucket=qmatmul_rows.key(*args),
                         config={"QMV_MAX_ROWS": 16, "GEMV": "qmv_h2", "TC_MIN_ROWS": 6, "WG_MIN_ROWS": 8,
                                 "WG_REPACKED": True},
                         time_s=1e-5)
    dispatch.reset()
    assert qmatmul_rows.choice_for(*args) == {"QMV_MAX_ROWS": 16, "GEMV": "qmv_h2", "TC_MIN_ROWS": 6, "WG_MIN_ROWS": 8,
                                              "WG_REPACKED": True}
    # a choice recorded for other kernel sources is stale and not served
    with TuningDB(url) as db:
        db.record_result(kernel=qmatmul_rows.name, source_hash="0" * 64, device=cpu_info(),
                         bucket="N=8,K=64,bits=4,gs=64", config={"QMV_MAX_ROWS": 0}, time_s=1e-6)
    dispatch.reset()
    assert qmatmul_rows.choice_for(*args)["QMV_MAX_ROWS"] == 16
    dispatch.reset()


def test_the_route_is_tunable_by_name_for_a_model():
    from kilnx.kernels import registry
    assert registry.get("qmatmul_rows_crossover") is qmatmul_rows
    # the CPU tunes the thresholds; the GPU one path per row count a decode graph runs (test_qmatmul_path.py)
    routes = [p for name, p in registry.problems_for_model("llama-3.2-1b", gpu=False) if name == "qmatmul_rows_crossover"]
    assert {"N": 2048, "K": 8192, "bits": 4, "gs": 64} in routes
    paths = [p for name, p in registry.problems_for_model("llama-3.2-1b") if name == "qmatmul_path"]
    assert [p["M"] for p in paths if (p["N"], p["K"]) == (2048, 8192)] == [1, 2, 4, 8, 16]
    # every dense projection of the model (qkv, o, gate_up, down, lm_head)
    assert {(p["N"], p["K"]) for p in paths} == {(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),
                                                 (128256, 2048)}
    # never per-call targets: timed alone, the winners decoded slower in the engine (registry.py); a model's tune
    # runs them in its decode step when named (tuner/step_paths.py)
    from kilnx.tuner.session import plan, step_tuned_named
    assert not [s for s in plan(models=["llama-3.2-1b"]) if s.kernel_ref == "qmatmul_path"]
    assert plan(models=["llama-3.2-1b"], kernels=["qmatmul_path"]) == []
    assert not [s for s in plan() if s.kernel_ref == "qmatmul_path"]
    assert step_tuned_named(["qmatmul_path", "qmv_h2", "kilnx.kernels.qmatmul_path:qmatmul_path"]) == [
        "qmatmul_path", "kilnx.kernels.qmatmul_path:qmatmul_path"]
    assert [s for s in plan(models=["llama-3.2-1b"]) if s.kernel_ref == "qmm_wg_direct"]   # the rest as before
    from kilnx.tuner.session import left_unless_named
    assert left_unless_named(["llama-3.2-1b"]) == ["qmatmul_path"]       # what `kilnx tune` tells the user
    assert left_unless_named(["llama-3.2-1b"], gpu=False) == []
    moe = [p for name, p in registry.problems_for_model("qwen3-30b-a3b") if name == "qmatmul_path"]
    assert moe and (1536, 2048) not in {(p["N"], p["K"]) for p in moe}    # the experts take the gather kernels
    assert not [name for name, _ in registry.problems_for_model("llama-3.2-1b") if name == "qmatmul_rows_crossover"]


def test_a_tune_records_a_choice(tmp_path):
    from kilnx.tuner.budget import Budget
    from kilnx.tuner.session import TargetSpec, tune_session
    from kilnx.tuner.study import TuneSettings
    url = f"sqlite:///{tmp_path}/tune.db"
    with TuningDB(url) as db:
        results = tune_session(cpu_info(), [TargetSpec("tests.kernels.test_routing:short_route", PROBLEM)], db,
                               Budget(120, 1), TuneSettings(trials=2, trial_timeout_s=60, rerank_rounds=1),
                               workers=1)
        stored = db.valid_results(cpu_info())
    assert not results[0].error, results[0].error
    assert [(r.kernel, r.bucket) for r in stored] == [("qmatmul_rows_crossover", "N=24,K=128,bits=4,gs=64")]
    assert stored[0].config["QMV_MAX_ROWS"] in (0, 1, 2, 4, 8, 16, 32)
    assert stored[0].config["GEMV"] in ("qmv", "qmv_h2", "qmv_il")


def test_qmatmul_decides_once_per_weight_and_row_count(monkeypatch):
    """qmatmul keeps the route's call per (weight, rows): repeated calls skip the decisions, another
    weight of the same shape gets its own, and reloaded tuned configs make it decide again."""
    from kilnx.dsl.kernel import forget_remembered_configs
    from kilnx.quant import QWeight
    asked = []
    real = qmatmul_rows.server
    monkeypatch.setattr(qmatmul_rows, "server", lambda *a, **k: asked.append(a[0].shape[0]) or real(*a, **k))
    x = torch.randn(1, 128)
    weights = [QWeight.quantize(torch.randn(24, 128, generator=torch.Generator().manual_seed(i))) for i in (1, 2)]
    for _ in range(3):
        for w in weights:
            torch.testing.assert_close(Q.qmatmul(x, w), x @ w.dequantize(torch.float32).T, rtol=1e-4, atol=1e-4)
    assert asked == [1, 1]
    forget_remembered_configs()
    Q.qmatmul(x, weights[0])
    assert asked == [1, 1, 1]


@pytest.mark.parametrize("m,n,want", [
    (128, 28672, False),   # gate_up: 224 programs of 128 x 128, the fused kernel fills the GPU
    (64, 28672, False),
    (128, 4096, False),    # o / down: 32 programs of 128 x 128 on 132 SMs, but 128 of 64 x 64
    (128, 6144, False),    # qkv: 48 of 128 x 128, 192 of 64 x 64
    (192, 6144, True),     # past the narrow tiles' rows a starved grid takes the two kernels
    (256, 28672, False),
    (16, 4096, False),     # few rows: the weight's 16-bit copy is the larger cost
    (64, 4096, False),     # 64-wide tiles, short per program: the fused kernel won with 64 programs
    (320, 28672, True),    # from the crossover's rows the two kernels whatever the grid
])
def test_the_two_kernel_path_takes_large_or_starved_fused_grids(m, n, want):
    assert two_kernels_win(m, n, 320, NARROW_TILE_MAX_ROWS, sms=132) is want


def test_without_narrow_tiles_a_starved_grid_takes_the_two_kernels_above_64_rows():
    assert two_kernels_win(128, 4096, 256, 64, sms=132) and not two_kernels_win(64, 4096, 256, 64, sms=132)


@pytest.mark.parametrize("m,n,block", [(65, 4096, 64), (128, 6144, 64), (129, 6144, 128), (128, 28672, 128),
                                       (64, 4096, 64), (40, 4096, 64)])
def test_the_packed_qmm_default_narrows_its_tiles_where_wide_ones_starve_the_grid(m, n, block):
    """Every row count the fused kernel serves on the GPU gets a tile of 132+ programs where one exists
    short of the two kernels' rows (on 132 SMs)."""
    assert Q._packed_tile(m, n, sms=132)["BLOCK_N"] == block


def test_the_cpu_never_takes_the_two_kernel_path():
    x, wq, s, b = Q.make_qmatmul_args({"M": 512, "N": 64, "K": 128, "bits": 4, "gs": 64}, "cpu")[:4]
    assert not takes_dequant_mm(x, wq, s, b)
