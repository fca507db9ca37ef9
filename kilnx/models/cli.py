"""`kilnx convert`: a dense safetensors checkpoint quantized once into an MLX-format directory."""

from __future__ import annotations

import sys
from typing import Optional

import typer
from typing_extensions import Annotated


def convert(
    model: Annotated[str, typer.Argument(help="A safetensors directory (HF dense, or MLX).")],
    out: Annotated[str, typer.Argument(help="The directory to write (must not exist yet).")],
    quantize: Annotated[str, typer.Option(help="q4, q8, mxfp4, nvfp4, or a mode (affine) with --bits.")] = "q4",
    bits: Annotated[Optional[int], typer.Option(help="Bits a code (affine: 2, 3, 4, 5, 6, 8).")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="Codes a scale (affine: 32, 64, 128).")] = None,
) -> None:
    """Quantize a dense checkpoint into an MLX-format directory (as `mlx_lm.convert -q` writes), for --model."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kilnx.models.convert import convert as run, quant_format
    from kilnx.models.errors import ModelError
    try:
        fmt = quant_format(quantize, bits, group_size)
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), transient=True) as bar:
            task = bar.add_task("quantizing", total=None)

            def progress(done: int, total: int, name: str) -> None:
                bar.update(task, completed=done, total=total, description=f"quantizing {name}"[:60])
            counts = run(model, out, fmt, progress=progress)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(1)
    kept = f", {counts['kept']} kept as they were" if counts["kept"] else ""
    print(f"wrote {out}: {counts['quantized']} weights quantized ({fmt.mode}, {fmt.bits}-bit, groups of "
          f"{fmt.group_size}){kept}, {counts['files']} file(s)")
