"""`kilnx db ...`: look at, move and tidy the tuning DB.

Every command takes --db URL (else KILNX_DB, else the user cache file). A DB problem prints one red
line saying what is wrong and how to fix it, and exits with status 1; no traceback.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kilnx.cache.errors import DBError, display_url
from kilnx.runtime.device import DeviceError, DeviceInfo, detect

if TYPE_CHECKING:   # imported when a command runs: `kilnx generate` never opens the DB through SQLAlchemy
    from kilnx.cache.db import TuningDB

db_app = typer.Typer(name="db", help="Inspect, export, import, prune and plot the tuning DB.",
                     no_args_is_help=True, add_completion=False)

_out = Console()
_err = Console(stderr=True)

DB_OPTION = typer.Option(None, "--db", metavar="URL",
                         help="Tuning DB URL (sqlite:///path or postgresql+psycopg://...); default: $KILNX_DB "
                              "or a SQLite file in the user cache dir.")


@contextmanager
def _opened(url: Optional[str]) -> Iterator["TuningDB"]:
    """Open the DB; turn DBError (and a bad --device) into one red line and exit 1."""
    try:
        from kilnx.cache.db import TuningDB
        with TuningDB(url) as db:
            yield db
    except (DBError, DeviceError) as e:
        _fail(str(e))


def _fail(message: str) -> None:
    # soft_wrap: the message stays one line whatever the terminal width.
    _err.print(f"[red]error: {escape(message)}[/red]", soft_wrap=True, highlight=False)
    raise typer.Exit(1)


def _device(request: Optional[str]) -> Optional[DeviceInfo]:
    return detect(request) if request else None


@db_app.command("show")
def show(db: Optional[str] = DB_OPTION,
         device: Optional[str] = typer.Option(
             None, "--device", help="Judge results against this device (auto, cpu, cuda:N): others show as "
                                    "stale. Default: every device's results are shown as theirs."),
         kernel: Optional[str] = typer.Option(None, "--kernel", help="Only this kernel."),
         as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Table of tuned results: kernel, bucket, device, config, time, speedup, status."""
    with _opened(db) as tuning_db:
        rows = tuning_db.all_results(_device(device))
        url = display_url(tuning_db.url)
    if kernel:
        rows = [(r, s) for r, s in rows if r.kernel == kernel]
    if as_json:
        _out.print_json(json.dumps([{**r.to_dict(), "status": s} for r, s in rows]))
        return
    if not rows:
        _out.print(f"no tuned results in {url}", soft_wrap=True)
        return
    table = Table(title=f"tuned results in {url}", title_justify="left")
    for column, justify in [("kernel", "left"), ("bucket", "left"), ("device", "left"), ("config", "left"),
                            ("time", "right"), ("speedup", "right"), ("status", "left")]:
        table.add_column(column, justify=justify, overflow="fold")
    for r, status in rows:
        speedup = f"{r.speedup:.2f}×" if r.speedup is not None else "–"
        style = "green" if status == "valid" else "yellow"
        table.add_row(r.kernel, r.bucket, r.device_key, escape(json.dumps(r.config, sort_keys=True)),
                      _format_time(r.time_s), speedup, f"[{style}]{escape(status)}[/{style}]")
    _out.print(table)


@db_app.command("export")
def export(file: Path = typer.Argument(..., metavar="FILE.json", help="Where to write the results."),
           db: Optional[str] = DB_OPTION,
           device: Optional[str] = typer.Option(None, "--device",
                                                help="Only this device's results (auto, cpu, cuda:N).")) -> None:
    """Write tuned results to a JSON file, to import them on another machine."""
    with _opened(db) as tuning_db:
        count = tuning_db.export_json(file, _device(device))
    _out.print(f"exported {count} result(s) to {file}", soft_wrap=True)


@db_app.command("import")
def import_(file: Path = typer.Argument(..., metavar="FILE.json", help="A file written by `kilnx db export`."),
            db: Optional[str] = DB_OPTION) -> None:
    """Merge results from a JSON export (the faster result wins per key); all or nothing."""
    with _opened(db) as tuning_db:
        count = tuning_db.import_json(file)
    _out.print(f"imported {count} result(s) from {file}", soft_wrap=True)


@db_app.command("prune")
def prune(db: Optional[str] = DB_OPTION,
          all_results: bool = typer.Option(False, "--all", help="Delete every result, not only stale ones.")) -> None:
    """Delete stale results (old kernel source or triton version); other GPUs' results are kept."""
    with _opened(db) as tuning_db:
        count = tuning_db.prune(stale_only=not all_results)
    _out.print(f"deleted {count} {'' if all_results else 'stale '}result(s)")


@db_app.command("plot")
def plot(out_dir: Path = typer.Argument(..., metavar="DIR", help="Directory for the PNG files."),
         db: Optional[str] = DB_OPTION,
         study: Optional[List[str]] = typer.Option(None, "--study", help="Only these Optuna studies (repeatable).")
         ) -> None:
    """PNGs: speedup vs default per kernel and bucket, and each Optuna study's optimization history."""
    with _opened(db) as tuning_db:
        paths = tuning_db.plot(out_dir, study or None)
    for path in paths:
        _out.print(str(path), soft_wrap=True)
    if not paths:
        _out.print("nothing to plot: no results with a default time and no completed studies")


def _format_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"
