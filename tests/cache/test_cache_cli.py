"""`kilnx db` commands through typer's CliRunner, on real DB files."""

from __future__ import annotations

import json

import optuna
import pytest
from typer.testing import CliRunner

from kilnx.cache import TuningDB
from kilnx.cache.cli import db_app

runner = CliRunner()


def invoke(*args: str, env: dict | None = None):
    return runner.invoke(db_app, list(args), env=env)


def assert_clean_error(result, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture
def filled_url(db_url, h200, a100) -> str:
    with TuningDB(db_url) as db:
        db.record_result(kernel="gemv", source_hash="old", device=h200, bucket="M=1,N=64", config={"B": 8},
                         time_s=3e-5, default_time_s=6e-5)
        db.record_result(kernel="gemv", source_hash="new", device=h200, bucket="M=1,N=64", config={"B": 64},
                         time_s=2e-5, default_time_s=6e-5)
        db.record_result(kernel="gemv", source_hash="new", device=a100, bucket="M=8,N=64", config={"B": 32},
                         time_s=4e-6)
    return db_url


def test_show_lists_results_with_speedup_and_status(filled_url):
    result = runner.invoke(db_app, ["show", "--db", filled_url, "--json"])
    assert result.exit_code == 0, result.output
    rows = {(r["source_hash"], r["device_key"]): r for r in json.loads(result.stdout)}
    assert rows[("new", "sm_90:NVIDIA H200")]["status"] == "valid"
    assert rows[("old", "sm_90:NVIDIA H200")]["status"].startswith("stale: kernel source changed")
    table = runner.invoke(db_app, ["show", "--db", filled_url], env={"COLUMNS": "250"})
    assert table.exit_code == 0, table.output
    for text in ("gemv", "M=1,N=64", "sm_90:NVIDIA H200", '{"B": 64}', "20 µs", "3.00×", "valid", "stale"):
        assert text in table.output, text


def test_show_judges_against_a_device(filled_url):
    result = runner.invoke(db_app, ["show", "--db", filled_url, "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert all("not this device cpu:" in r["status"] for r in json.loads(result.stdout))


def test_show_uses_kilnx_db_env(filled_url):
    result = runner.invoke(db_app, ["show", "--json"], env={"KILNX_DB": filled_url})
    assert result.exit_code == 0 and len(json.loads(result.stdout)) == 3


def test_export_import_prune(filled_url, tmp_path):
    out = tmp_path / "results.json"
    result = invoke("export", str(out), "--db", filled_url)
    assert result.exit_code == 0 and "exported 3 result(s)" in result.output
    fresh = f"sqlite:///{tmp_path}/fresh.db"
    result = invoke("import", str(out), "--db", fresh)
    assert result.exit_code == 0 and "imported 3 result(s)" in result.output
    with TuningDB(fresh) as db:
        assert len(db.all_results()) == 3
    result = invoke("prune", "--db", fresh)
    assert result.exit_code == 0 and "deleted 1 stale result(s)" in result.output
    result = invoke("prune", "--db", fresh, "--all")
    assert result.exit_code == 0 and "deleted 2 result(s)" in result.output


def test_plot_writes_pngs(filled_url, tmp_path):
    with TuningDB(filled_url) as db:
        study = optuna.create_study(study_name="gemv M=1", storage=db.optuna_storage())
        study.optimize(lambda t: (t.suggest_int("B", 1, 64) - 40) ** 2 + 1, n_trials=4)
    result = invoke("plot", str(tmp_path / "plots"), "--db", filled_url)
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["history_gemv_M=1.png", "speedup_gemv.png"]
    for name in names:
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_clean_error(invoke("plot", str(tmp_path / "p2"), "--db", filled_url, "--study", "nope"),
                       "no Optuna study named nope", "gemv M=1")


def test_errors_are_one_red_line_without_traceback(tmp_path):
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"\x00garbage" * 512)
    assert_clean_error(invoke("show", "--db", f"sqlite:///{corrupt}"), str(corrupt), "not a readable SQLite")
    assert_clean_error(invoke("show", "--db", "postgresql+psycopg://x@127.0.0.1:1/x"), "cannot connect")
    assert_clean_error(invoke("prune", "--db", "what"), "is not a database URL")
    good = f"sqlite:///{tmp_path}/good.db"
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    assert_clean_error(invoke("import", str(bad_json), "--db", good), "is not valid JSON", "nothing was imported")
    assert_clean_error(invoke("export", str(tmp_path / "x.json"), "--db", good, "--device", "sm_999"), "sm_999")


def test_error_line_is_red_on_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    from kilnx.cache import cli
    monkeypatch.setattr(cli, "_err", cli.Console(stderr=True, force_terminal=True, color_system="standard"))
    result = invoke("show", "--db", "nonsense")
    assert result.exit_code == 1 and "\x1b[31m" in result.output
