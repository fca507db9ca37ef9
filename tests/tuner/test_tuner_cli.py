"""`kilnx tune` as a command: a device this machine lacks, and a small tune of a fake kernel."""

import typer
from typer.testing import CliRunner

from kilnx.cache import TuningDB
from kilnx.tuner.cli import tune

app = typer.Typer(add_completion=False)
app.command("tune")(tune)


@app.command("other")
def _other():  # a second command, so typer keeps "tune" as a subcommand like the real app
    pass


def test_a_device_this_machine_lacks_is_one_clear_error():
    result = CliRunner().invoke(app, ["tune", "--device", "sm_90", "--budget", "1m"])
    assert result.exit_code != 0
    text = result.output.strip()
    assert "sm_90" in text and "Traceback" not in text
    assert len(text.splitlines()) == 1, text


def test_a_bad_budget_is_one_clear_error():
    result = CliRunner().invoke(app, ["tune", "--device", "cpu", "--budget", "soon"])
    assert result.exit_code != 0 and "--budget" in result.output and "Traceback" not in result.output


def test_tune_command_prints_the_table_and_records(sqlite_url, cpu, tmp_path):
    csv_file = tmp_path / "tune.csv"
    result = CliRunner().invoke(app, ["tune", "--device", "cpu", "--kernel", "tests.tuner.fake_kernels:scale_add",
                                      "--trials", "4", "--budget", "60s", "--db", sqlite_url, "--csv", str(csv_file)])
    assert result.exit_code == 0, result.output
    assert "M=4,N=64" in result.output and "geomean speedup vs default" in result.output
    with TuningDB(sqlite_url) as db:
        stored = db.valid_results(cpu)
    assert sorted(r.bucket for r in stored) == ["M=4,N=64", "M=8,N=64"]
    assert all(r.trials == 4 and r.time_s <= r.default_time_s for r in stored)
    import csv
    rows = list(csv.DictReader(csv_file.open()))
    speedups = {r["case"]: float(r["value"]) for r in rows if r["metric"] == "speedup"}
    assert set(speedups) == {"tune_fake_scale_add_M=4_N=64", "tune_fake_scale_add_M=8_N=64",
                             "tune_geomean_speedup_vs_default"}
    # the fake kernel's default (BLOCK=4) costs ~50 us and its best ~10 us: the tune must find it
    assert speedups["tune_geomean_speedup_vs_default"] > 1.5
