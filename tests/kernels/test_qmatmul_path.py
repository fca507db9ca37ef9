"""Which kernel serves one weight at one row count is a tuned choice per (weight, rows): every path that serves a
call gives qmatmul's answer, a path that cannot serve it is refused by name, nothing stored means the thresholds'
path, a stored path is what the runtime runs for that weight and row count only, and a tune tries every path."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kilnx.cache import TuningDB
from kilnx.kernels import qmatmul as Q
from kilnx.kernels.qmatmul_path import MAX_ROWS, qmatmul_path
from kilnx.kernels.routing import PATHS, qmatmul_rows
from kilnx.runtime import dispatch
from kilnx.runtime.device import cpu_info

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")
# the smallest weight every path takes: N a multiple of 64 and K of 128 for the wgmma kernels
PROBLEM = {"N": 64, "K": 128, "bits": 4, "gs": 64}
SERVED_ON_CPU = tuple(p for p in PATHS if p != "dequant_mm")


def _args(m: int):
    return Q.make_qmatmul_args({**PROBLEM, "M": m}, "cpu")


@interpreted
@settings(max_examples=12, deadline=None)
@given(path=st.sampled_from(SERVED_ON_CPU), m=st.sampled_from((1, 2, 3, 4, 7, 8, 16)))
def test_every_path_that_serves_a_call_gives_the_reference(path, m):
    args = _args(m)
    got = qmatmul_path.compile({"PATH": path}, *args, backend="triton")(*args)
    want = qmatmul_path.reference(*args)
    rtol, atol = qmatmul_path.tolerance(args)
    assert got.shape == (m, PROBLEM["N"]) and got.dtype == args[0].dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@interpreted
def test_a_path_that_cannot_serve_the_call_is_refused_by_name():
    x, wq, s, b = _args(4)
    with pytest.raises(ValueError, match="'dequant_mm' does not serve"):     # the GPU's two kernels
        qmatmul_path.compile({"PATH": "dequant_mm"}, x, wq, s, b)
    with pytest.raises(ValueError, match="'qmm_wg_direct' does not serve"):  # wgmma takes bf16 rows only
        qmatmul_path.compile({"PATH": "qmm_wg_direct"}, x.float(), wq, s, b)
    with pytest.raises(ValueError, match="'qmm_wg' does not serve"):         # nor more than 64 of them
        qmatmul_path.compile({"PATH": "qmm_wg"}, *_args(65))


def test_buckets_name_the_weight_and_rows_so_no_other_weight_is_nearest():
    assert qmatmul_path.key(*_args(4)) == "W=64x128b4g64,M=4"
    other = dispatch.parse_bucket("W=128x128b4g64,M=4")
    assert dispatch.bucket_distance(dispatch.parse_bucket("W=64x128b4g64,M=4"), other) == float("inf")


@interpreted
def test_nothing_stored_means_the_thresholds_path(tmp_path, monkeypatch):
    monkeypatch.setenv("KILNX_DB", f"sqlite:///{tmp_path}/none.db")
    dispatch.reset()
    for m in (1, 4, 16):
        args = _args(m)
        chosen = qmatmul_rows.choice_for(*args)
        rule = qmatmul_rows.rule_path(*args, qmatmul_rows.thresholds_for(*args))
        assert chosen["PATH"] == rule == qmatmul_path.default_config(*args)["PATH"] == "qmv_il"  # the CPU's GEMV
    assert "PATH" not in qmatmul_rows.choice_for(*_args(MAX_ROWS + 1))
    dispatch.reset()


@interpreted
def test_a_stored_path_serves_its_weight_at_its_rows_only(tmp_path, monkeypatch):
    from kilnx.dsl.kernel import forget_remembered_configs
    from kilnx.quant import QWeight
    url = f"sqlite:///{tmp_path}/tuned.db"
    monkeypatch.setenv("KILNX_DB", url)
    w = QWeight.quantize(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)))
    other = QWeight.quantize(torch.randn(128, 128, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    args4 = (x[:4], w.packed, w.scales, w.biases)
    with TuningDB(url) as db:
        db.record_result(kernel=qmatmul_path.name, source_hash=qmatmul_path.source_hash, device=cpu_info(),
                         bucket=qmatmul_path.key(*args4), config={"PATH": "qmm"}, time_s=1e-5)
    dispatch.reset()
    forget_remembered_configs()
    used = []
    real = Q.qmm
    monkeypatch.setattr(Q, "qmm", lambda *a, **k: used.append(a[0].shape[0]) or real(*a, **k))
    for rows in (4, 16):
        want = x[:rows].float() @ w.dequantize(torch.float32).T
        torch.testing.assert_close(Q.qmatmul(x[:rows], w).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    Q.qmatmul(x[:4], other)
    # 4 rows of w take the stored qmm; 16 rows of w (no bucket of their own: stored paths hold only at their rows)
    # and the other weight take their rule
    assert used == [4]
    assert qmatmul_rows.choice_for(x, w.packed, w.scales, w.biases)["PATH"] == "qmv_il"
    assert qmatmul_rows.choice_for(x[:4], other.packed, other.scales, other.biases)["PATH"] == "qmv_il"
    # A/Bs set the stored path aside: KILNX_QMATMUL_PATH=rule, or a KILNX_WG setting of the thresholds
    assert qmatmul_rows.path(*args4, qmatmul_rows.choice_for(*args4)) == "qmm"
    for var, value in (("KILNX_QMATMUL_PATH", "rule"), ("KILNX_WG", "0")):
        monkeypatch.setenv(var, value)
        assert qmatmul_rows.path(*args4, qmatmul_rows.choice_for(*args4)) == "qmv_il"
        monkeypatch.delenv(var)
    dispatch.reset()
    forget_remembered_configs()


@interpreted
def test_a_tune_tries_every_path_and_stores_one_that_serves(tmp_path):
    from kilnx.tuner.budget import Budget
    from kilnx.tuner.session import TargetSpec, tune_session
    from kilnx.tuner.study import TuneSettings
    url = f"sqlite:///{tmp_path}/tune.db"
    with TuningDB(url) as db:
        results = tune_session(cpu_info(), [TargetSpec("kilnx.kernels.qmatmul_path:qmatmul_path",
                                                          {**PROBLEM, "M": 2})],
                               db, Budget(600, 1), TuneSettings(trial_timeout_s=120, rerank_rounds=1), workers=1)
        stored = db.valid_results(cpu_info())
    assert not results[0].error, results[0].error
    assert [(r.kernel, r.bucket) for r in stored] == [("qmatmul_path", "W=64x128b4g64,M=2")]
    assert stored[0].config["PATH"] in SERVED_ON_CPU
    import optuna
    study = optuna.load_study(study_name=results[0].study_name, storage=url)
    tried = {t.params.get("PATH") for t in study.trials}
    assert tried == set(PATHS)


@pytest.mark.gpu
@pytest.mark.parametrize("m", (1, 4, 16))
def test_every_path_serves_llama_shapes_on_the_gpu(m):
    """Each path the tuner may store for llama-3.1-8b's o projection (4096 x 4096, 4-bit group 64, bf16) gives the
    reference on the GPU, the two-kernel dequant_mm and both wgmma kernels included."""
    args = Q.make_qmatmul_args({"M": m, "N": 4096, "K": 4096, "bits": 4, "gs": 64}, "cuda")
    want = qmatmul_path.reference(*args)
    rtol, atol = qmatmul_path.tolerance(args)
    for path in PATHS:
        assert qmatmul_rows.serves(path, *args), path
        got = qmatmul_path.compile({"PATH": path}, *args)(*args)
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, msg=path)
