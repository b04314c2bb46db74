"""``llmjobs``: run the service (serve, api, worker), run one job in the foreground (run), and talk to the API.

The commands live in one module per audience: ``cli.service`` (service processes), ``cli.local`` (local runs),
``cli.remote`` (client commands over HTTP), ``cli.chat`` (a conversation with a deployment) and ``cli.tokens`` (API
tokens).
"""

from __future__ import annotations

import typer

from cli import chat, local, remote, service
from cli.tokens import token_cli

cli = typer.Typer(add_completion=False, no_args_is_help=True, help="Qwen3 fine-tuning job service.")
cli.command()(service.serve)
cli.command()(service.api)
cli.command()(service.worker)
cli.command()(service.gc)
cli.command()(service.reseal)
cli.command("slurm-agent")(service.slurm_agent)
cli.command()(local.run)
cli.command()(remote.submit)
cli.command("list")(remote.list_)
cli.command()(remote.status)
cli.command()(remote.logs)
cli.command()(remote.metrics)
cli.command()(remote.cancel)
cli.command()(remote.events)
cli.command()(remote.artifacts)
cli.command()(remote.wait)
cli.command()(remote.delete)
cli.command()(remote.download)
cli.command()(remote.checkpoints)
cli.command()(remote.upload)
cli.command()(remote.files)
cli.command("delete-file")(remote.delete_file)
cli.command()(chat.chat)
cli.add_typer(token_cli, name="token")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
