"""``llmjobs``: run the service (serve, api, worker), run one job in the foreground (run), and talk to the API.

The commands live in one module per audience: ``cli.service`` (service processes), ``cli.local`` (local runs),
``cli.remote`` (client commands over HTTP), ``cli.chat`` (a conversation with a deployment) and ``cli.tokens`` (API
tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from cli import chat, local, remote, service
from cli.tokens import token_cli

cli = typer.Typer(add_completion=False, no_args_is_help=True, help="Qwen3 fine-tuning job service.")
# Every command in the order `llmjobs --help` lists them; named as its function unless a name is given.
COMMANDS: list[tuple[Callable[..., Any], str | None]] = [
    (service.serve, None),
    (service.api, None),
    (service.worker, None),
    (service.gc, None),
    (service.reseal, None),
    (service.slurm_agent, "slurm-agent"),
    (local.run, None),
    (remote.submit, None),
    (remote.list_, "list"),
    (remote.status, None),
    (remote.logs, None),
    (remote.metrics, None),
    (remote.cancel, None),
    (remote.events, None),
    (remote.artifacts, None),
    (remote.wait, None),
    (remote.delete, None),
    (remote.download, None),
    (remote.checkpoints, None),
    (remote.upload, None),
    (remote.files, None),
    (remote.delete_file, "delete-file"),
    (chat.chat, None),
]
for command, name in COMMANDS:
    cli.command(name)(command)
cli.add_typer(token_cli, name="token")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
