"""Local runs: ``run`` executes one job (or pipeline) in the foreground, with no server or database."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.env import load_settings


def run(
    spec_file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="a job spec (JSON)")],
    run_dir: Annotated[Path | None, typer.Option(help="default <runs_dir>/local-<time>")] = None,
) -> None:
    """Run one job in the foreground, without a server, writing the same run directory a worker would."""
    from pydantic import ValidationError

    from core.errors import validation_errors
    from worker.foreground import run_foreground

    try:
        code = run_foreground(spec_file, run_dir, load_settings().runs_path)
    except ValidationError as err:
        for item in validation_errors(err.errors()):
            typer.echo(f"error: {spec_file}: {item['message']}", err=True)
        raise typer.Exit(2) from err
    except ValueError as err:
        typer.echo(f"error: {spec_file}: {err}", err=True)
        raise typer.Exit(2) from err
    raise typer.Exit(code)
