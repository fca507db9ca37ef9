"""The `kilnx` command: tune, generate, chat, bench, serve, convert, db, kernels."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from kilnx.cache.cli import db_app
from kilnx.models.cli import convert
from kilnx.runtime.chat import chat
from kilnx.runtime.cli import bench, generate, serve
from kilnx.tuner.cli import tune

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="kilnx: a JIT kernel compiler and autotuner for LLM inference.")
app.command("tune")(tune)
app.command("generate")(generate)
app.command("chat")(chat)
app.command("bench")(bench)
app.command("serve")(serve)
app.command("convert")(convert)
app.add_typer(db_app, name="db", help="The tuning database: show, export, import, prune, plot.")

kernels_app = typer.Typer(no_args_is_help=True, help="The kernel library.")
app.add_typer(kernels_app, name="kernels")
console = Console()


@kernels_app.command("list")
def kernels_list(tuned: bool = typer.Option(False, "--tuned", help="Show tuned buckets for this device."),
                 device: str = typer.Option("auto", help="Device whose tuned results to show."),
                 db: str = typer.Option(None, help="Tuning DB URL (default: KILNX_DB or the user cache).")):
    """Every registered kernel with its tunables (and, with --tuned, its tuned buckets here)."""
    from kilnx.kernels import registry
    coverage = {}
    if tuned:
        from kilnx.cache import DBError, TuningDB
        from kilnx.runtime.device import DeviceError, detect
        from kilnx.runtime.dispatch import TunedConfigs
        try:
            coverage = TunedConfigs.load(detect(device), TuningDB(db)).coverage()
        except (DBError, DeviceError) as e:
            console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1)
    t = Table(title="kilnx kernels")
    t.add_column("kernel")
    t.add_column("tunables")
    if tuned:
        t.add_column("tuned buckets")
    for k in registry.all():
        row = [k.name, k.space.describe()]
        if tuned:
            row.append(", ".join(coverage.get(k.name, [])) or "-")
        t.add_row(*row)
    console.print(t)


@kernels_app.command("show")
def kernels_show(name: str, config: str = typer.Option(None, help="JSON config (default: the default config).")):
    """Print the Triton source generated for a sample specialization of kernel NAME."""
    import json

    from kilnx.kernels import registry
    try:
        k = registry.get(name)
    except KeyError as e:
        console.print(f"[red]error:[/red] {e.args[0]}")
        raise typer.Exit(1)
    problems = k.sample_problems()
    if not problems or k.make_args is None:
        console.print(f"[red]error:[/red] kernel {name} declares no sample problem to specialize on")
        raise typer.Exit(1)
    args = k.make_args(problems[0], "cpu")
    cfg = json.loads(config) if config else None
    console.print(f"# problem {problems[0]}")
    console.print(Syntax(k.triton_source(*args, config=cfg), "python"))


def main():
    app()


if __name__ == "__main__":
    main()
