"""qmatmul's path per (weight, rows) tuned in the model's decode step: every path that serves a weight is captured
as the step it runs in, checked against the thresholds' step, timed interleaved with the incumbent, kept only where
the step is faster by the margin, confirmed against the thresholds' step, and stored for its own row count only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kilnx.cache import TuningDB
from kilnx.kernels.qmatmul_path import qmatmul_path
from kilnx.kernels.routing import qmatmul_rows
from kilnx.runtime import dispatch
from kilnx.runtime.device import cpu_info
from kilnx.runtime.engine import Engine
from kilnx.tuner import step_paths
from kilnx.tuner.step_paths import StepTrial, record, tune_step_paths

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from tiny_models import tiny_model  # noqa: E402

GATE_UP = "W=256x64b4g64"     # the tiny llama's [gate | up] weight (the largest: tried first)


@pytest.fixture
def engine(monkeypatch):
    # Triton's runtime helpers read TRITON_INTERPRET when first imported: imported under 1 (the suite's setting)
    # before this test sets 0, so that the Triton tests after it still run in the interpreter
    import kilnx.codegen.triton_rt  # noqa: F401
    monkeypatch.setenv("TRITON_INTERPRET", "0")      # numba kernels, replayed as the CPU engine replays a step
    return Engine(tiny_model("llama", ops="kilnx", device="cpu", fmt="q4"), max_seq=32, max_batch=4)


class ScriptedTimes(StepTrial):
    """Step times from a table instead of a clock: a step costs 1 ms, less where it runs a listed (bucket, path)."""

    def __init__(self, engine, savings: dict[tuple[str, str], float]):
        super().__init__(engine, rounds=1, reps=1)
        self.savings, self.captured = savings, []

    def capture(self, rows, paths):
        step, asked = super().capture(rows, paths)
        step.paths = {b: paths.get(b, c.default) for b, c in asked.items()}
        self.captured.append(step.paths)
        return step, asked

    def time(self, steps):
        return [1e-3 - sum(s for (b, p), s in self.savings.items() if s_.paths.get(b) == p) for s_ in steps]


def test_the_thresholds_stay_where_no_path_beats_them(engine):
    trial = ScriptedTimes(engine, {})
    (result,) = [step_paths.tune_rows(trial, 2)]
    assert result.chosen == {} and not result.kept and result.step_s is None
    # every weight the step multiplies was tried, on every path that serves it (the CPU's four), largest first
    assert set(result.defaults) == {f"{w},M=2" for w in (GATE_UP, "W=128x64b4g64", "W=64x128b4g64", "W=64x64b4g64")}
    assert list(result.tried) == [f"{GATE_UP},M=2", "W=128x64b4g64,M=2", "W=64x128b4g64,M=2", "W=64x64b4g64,M=2"]
    for bucket, tried in result.tried.items():
        assert {t.path for t in tried} == {"qmv_il", "qmv", "qmv_h2", "qmm"}
        assert all(t.step_s is not None for t in tried) and [t.note for t in tried][0] == "incumbent"


def test_a_path_that_makes_the_step_faster_is_kept_and_confirmed(engine):
    trial = ScriptedTimes(engine, {(f"{GATE_UP},M=2", "qmm"): 5e-5, ("W=64x64b4g64,M=2", "qmv"): 5e-6})
    result = step_paths.tune_rows(trial, 2)
    # 5% kept; 0.5% is inside the margin
    assert result.chosen == {f"{GATE_UP},M=2": "qmm"} and result.kept
    assert result.default_step_s == pytest.approx(1e-3) and result.step_s == pytest.approx(1e-3 - 5e-5)
    # later weights were tried with the kept path held, and the last comparison captured the thresholds' step
    assert trial.captured[-1][f"{GATE_UP},M=2"] == "qmm" and trial.captured[-2][f"{GATE_UP},M=2"] == "qmv_il"
    assert all(p[f"{GATE_UP},M=2"] == "qmm" for p in trial.captured[5:-2])


def test_a_path_giving_wrong_numbers_is_never_timed_and_one_that_fails_is_reported(engine, monkeypatch):
    real = qmatmul_rows.server_of_path

    def broken(path, x, wq, scales, biases, backend=None):
        if path == "qmv":       # the GEMM on scales three times the weight's: a launch of wrong numbers
            wrong = scales * 3
            server = real("qmm", x, wq, wrong, biases, backend)
            return lambda x, wq, scales, biases: server(x, wq, wrong, biases)
        if path == "qmv_h2":
            raise RuntimeError("out of resources: shared memory")
        return real(path, x, wq, scales, biases, backend)
    monkeypatch.setattr(qmatmul_rows, "server_of_path", broken)
    trial = ScriptedTimes(engine, {(f"{GATE_UP},M=1", "qmv"): 5e-4})
    result = step_paths.tune_rows(trial, 1)
    notes = {t.path: t for t in result.tried[f"{GATE_UP},M=1"]}
    assert notes["qmv"].note.startswith("wrong: logits off by") and notes["qmv"].step_s is None
    assert notes["qmv_h2"].note == "fails: RuntimeError: out of resources: shared memory"
    assert notes["qmm"].step_s is not None and result.chosen == {}


def test_kept_paths_are_stored_for_their_rows_only_and_the_runtime_takes_them(engine, tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/tuned.db"
    monkeypatch.setenv("KILNX_DB", url)
    trial = ScriptedTimes(engine, {(f"{GATE_UP},M=2", "qmm"): 1e-4})
    results = [step_paths.tune_rows(trial, 2), step_paths.tune_rows(trial, 4)]
    with TuningDB(url) as db:
        assert record(db, cpu_info(), results) == 1
        stored = db.valid_results(cpu_info())
    assert [(r.kernel, r.bucket, r.config, r.time_s, r.default_time_s) for r in stored] == [
        ("qmatmul_path", f"{GATE_UP},M=2", {"PATH": "qmm"}, pytest.approx(9e-4), pytest.approx(1e-3))]
    dispatch.reset()
    try:
        w = engine.model.weights.layers[0].gate_up[0]
        for rows, want in ((2, "qmm"), (1, "qmv_il"), (4, "qmv_il")):
            x = torch.zeros(rows, 64)
            assert qmatmul_rows.choice_for(x, w.packed, w.scales, w.biases)["PATH"] == want
    finally:
        dispatch.reset()


def test_rows_the_budget_does_not_reach_are_reported_not_tried(engine):
    results = tune_step_paths(engine, (1, 2), seconds=1e-9)
    assert [(r.rows, r.error) for r in results] == [(1, "not started: the budget was spent"),
                                                    (2, "not started: the budget was spent")]
    with pytest.raises(ValueError, match="at most"):
        tune_step_paths(engine, (8,))


def test_a_trial_sets_stored_paths_aside_forces_its_own_and_nests_nowhere(tmp_path, monkeypatch):
    from kilnx.quant import QWeight
    url = f"sqlite:///{tmp_path}/tuned.db"
    monkeypatch.setenv("KILNX_DB", url)
    w = QWeight.quantize(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)))
    x = torch.zeros(4, 128)
    args = (x, w.packed, w.scales, w.biases)
    bucket = qmatmul_path.key(*args)
    with TuningDB(url) as db:
        db.record_result(kernel=qmatmul_path.name, source_hash=qmatmul_path.source_hash, device=cpu_info(),
                         bucket=bucket, config={"PATH": "qmm"}, time_s=1e-3)
    dispatch.reset()
    try:
        assert qmatmul_path.path_for(*args) == "qmm"                          # stored
        with qmatmul_path.trying({}) as trial:
            assert qmatmul_path.path_for(*args) == "qmv_il"                   # set aside: the thresholds' path
            assert trial.asked[bucket].default == "qmv_il" and trial.asked[bucket].rows == 4
            # fp32 rows on the CPU: neither the tensor-core kernels nor the GPU's dequantize-then-GEMM
            assert set(trial.asked[bucket].serving) == {"qmv", "qmv_h2", "qmv_il", "qmm"}
            with pytest.raises(RuntimeError, match="already open"):
                with qmatmul_path.trying({}):
                    pass
        with qmatmul_path.trying({bucket: "qmv"}):
            assert qmatmul_path.path_for(*args) == "qmv"                      # forced
        with qmatmul_path.trying({bucket: "dequant_mm"}):                     # does not serve the CPU: the default
            assert qmatmul_path.path_for(*args) == "qmv_il"
        assert qmatmul_path._trial is None and qmatmul_path.path_for(*args) == "qmm"   # stored again after
    finally:
        dispatch.reset()


def test_kilnx_tune_runs_it_for_a_named_model_and_refuses_it_without_one(engine, tmp_path, monkeypatch):
    import csv

    import typer
    from typer.testing import CliRunner

    from kilnx.tuner.cli import tune
    app = typer.Typer(add_completion=False)
    app.command("tune")(tune)
    app.command("other")(lambda: None)
    refused = CliRunner().invoke(app, ["tune", "--device", "cpu", "--kernel", "qmatmul_path", "--budget", "1m"])
    assert refused.exit_code == 1 and "--model" in refused.output and "Traceback" not in refused.output

    # the model's step on the tiny llama (a preset would load a real size), its clock scripted
    saving = {(f"{GATE_UP},M=2", "qmm"): 1e-4}
    monkeypatch.setattr(step_paths, "StepTrial", lambda eng, **kw: ScriptedTimes(eng, saving))
    monkeypatch.setattr(step_paths, "tune_model", lambda model, device, seconds, on_progress:
                        tune_step_paths(engine, (1, 2), seconds=seconds, on_progress=on_progress))
    url, out = f"sqlite:///{tmp_path}/tuned.db", tmp_path / "tune.csv"
    ran = CliRunner().invoke(app, ["tune", "--device", "cpu", "--model", "llama-3.2-1b", "--kernel", "qmatmul_path",
                                   "--budget", "60s", "--db", url, "--csv", str(out)])
    assert ran.exit_code == 0, ran.output
    assert "llama-3.2-1b: 1 path(s) stored" in ran.output and "Traceback" not in ran.output
    with TuningDB(url) as db:
        assert [(r.bucket, r.config) for r in db.valid_results(cpu_info())] == [(f"{GATE_UP},M=2", {"PATH": "qmm"})]
    rows = {(r["case"], r["metric"]): (r["value"], r["peer_value"]) for r in csv.DictReader(out.open())}
    case = "tune_step_qmatmul_path_llama-3.2-1b"
    assert {k: v for k, v in rows.items() if k[0] in (f"{case}_B1", f"{case}_B2")} == {
        (f"{case}_B1", "speedup"): ("1", "0"), (f"{case}_B2", "speedup"): (f"{1e-3 / 9e-4:.4g}", "1000"),
        (f"{case}_B2", f"path_{GATE_UP}"): ("qmm", "qmv_il")}
    # per weight: the incumbent's step and the best other path's ratio to it
    assert rows[(f"{case}_B2_{GATE_UP}", "step_us")] == ("1000", "qmv_il")
    assert rows[(f"{case}_B2_{GATE_UP}", "best_other_step_ratio")] == ("0.9", "qmm")
    assert rows[(f"{case}_B1_{GATE_UP}", "best_other_step_ratio")][0] == "1"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("rows", [1, 16])
def test_every_path_gives_the_thresholds_step_on_a_real_size_model_on_gpu(rows, capsys):
    """llama-3.2-1b (random 4-bit) on the GPU: each weight on each path that serves it, the rest on the thresholds'
    paths; the step's logits against the thresholds' (printed per path: what the gate's tolerance must admit)."""
    from kilnx.models.loaders import load_model
    lm = load_model("llama-3.2-1b", device="cuda", random=True)
    engine = Engine(lm.model, max_seq=step_paths.PROMPT + 8, max_batch=16, cuda_graphs=False)
    trial = StepTrial(engine, rounds=1, reps=1)
    base, asked = trial.capture(rows, {})
    reference = trial.logits(base)
    errors = {}
    for bucket, call in asked.items():
        for path in call.serving:
            step, _ = trial.capture(rows, {bucket: path})
            got = trial.logits(step)
            errors[(bucket.split(",")[0], path)] = float((got - reference).norm() / reference.norm())
    with capsys.disabled():
        print(f"\nrows {rows}: " + ", ".join(f"{w} {p} {e:.3g}" for (w, p), e in sorted(errors.items())))
    assert max(errors.values()) <= step_paths.TOLERANCE, errors
