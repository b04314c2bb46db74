"""``llmjobs token``: API tokens, written to the database directly (run where the database is reachable)."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.env import load_settings, prepare

token_cli = typer.Typer(no_args_is_help=True, help="API tokens.")


@token_cli.command("create")
def token_create(
    team: Annotated[str, typer.Option(help="the team whose jobs this token sees")],
    name: Annotated[str | None, typer.Option()] = None,
    admin: Annotated[bool, typer.Option(help="sees every team's jobs")] = False,
) -> None:
    """Create an API token (written to the database directly; printed once)."""
    from core.auth import create_token
    from core.db import session_scope

    settings = load_settings()
    prepare(settings)
    try:
        with session_scope(settings.database_url) as session:
            typer.echo(create_token(session, team=team, name=name, admin=admin))
    except ValueError as err:  # a team name that cannot name the team's data directory
        raise typer.BadParameter(str(err), param_hint="--team") from None


@token_cli.command("list")
def token_list(team: Annotated[str | None, typer.Option(help="only this team's tokens")] = None) -> None:
    """List API tokens: id, prefix, team, name, admin, created, active or revoked."""
    from core.auth import list_tokens
    from core.db import session_scope

    settings = load_settings()
    prepare(settings)
    with session_scope(settings.database_url) as session:
        for t in list_tokens(session, team):
            typer.echo(
                f"{t.id}\t{t.prefix}\t{t.team}\t{t.name or '-'}\t{'admin' if t.admin else '-'}\t"
                f"created {t.created_at:%Y-%m-%d %H:%M}\t"
                f"{'revoked ' + format(t.revoked_at, '%Y-%m-%d %H:%M') if t.revoked_at else 'active'}"
            )


@token_cli.command("revoke")
def token_revoke(
    ref: Annotated[str, typer.Argument(help="token id (from `token list`), its prefix, or the token")],
) -> None:
    """Revoke an API token: requests with it are refused (401) from now on."""
    from core.auth import revoke_token
    from core.db import session_scope

    settings = load_settings()
    prepare(settings)
    with session_scope(settings.database_url) as session:
        try:
            revoked = revoke_token(session, ref)
        except ValueError as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from err
    if not revoked:
        typer.echo(f"no active token matches {ref!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {ref}", err=True)
