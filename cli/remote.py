"""Remote client commands: talk to a running API at LLMJOBS_URL with LLMJOBS_TOKEN."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.client import Client, ClientError


def _echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, ensure_ascii=False))


def _client_call(method: str, path: str, **kwargs: Any) -> Any:
    try:
        return Client().request(method, path, **kwargs)
    except ClientError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from err


def submit(
    spec_file: Annotated[Path, typer.Argument(help="a job spec (JSON); - for stdin")],
    idempotency_key: Annotated[str | None, typer.Option(help="a replay with the same key returns the same job")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="stream the job until it ends")] = False,
) -> None:
    """Submit a job spec to the server."""
    text = sys.stdin.read() if str(spec_file) == "-" else spec_file.read_text()
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    job = _client_call("POST", "/v1/jobs", content=text, headers={**headers, "Content-Type": "application/json"})
    typer.echo(f"{job['id']} {job['state']}")
    if follow:
        _follow(job["id"])


def list_(
    state: Annotated[str | None, typer.Option()] = None, kind: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option()] = 20,
) -> None:
    """Your team's jobs, newest first."""
    params = {k: v for k, v in {"state": state, "kind": kind, "limit": limit}.items() if v is not None}
    page = _client_call("GET", "/v1/jobs", params=params)
    for job in page["data"]:
        typer.echo(f"{job['id']}  {job['kind']:<10} {job['state']:<10} {job['created_at']}  {job['name'] or ''}")


def status(job_id: str) -> None:
    """One job as JSON."""
    _echo_json(_client_call("GET", f"/v1/jobs/{job_id}"))


def logs(
    job_id: str, follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
    rank: Annotated[int | None, typer.Option(help="a rank's own log instead of the launcher's")] = None,
) -> None:
    """A job's log lines (with -f: until the job ends)."""
    if follow:
        _follow(job_id, only_logs=True)
        return
    offset = 0
    while True:
        params: dict[str, Any] = {"offset": offset, "limit": 5000, **({"rank": rank} if rank is not None else {})}
        page = _client_call("GET", f"/v1/jobs/{job_id}/logs", params=params)
        for line in page["data"]:
            typer.echo(line["text"])
        offset = page["next_offset"]
        if not page["has_more"]:
            return


def metrics(job_id: str, names: Annotated[str | None, typer.Option(help="comma-separated")] = None) -> None:
    """A job's metric points, one line per point."""
    since = -1
    while True:
        page = _client_call("GET", f"/v1/jobs/{job_id}/metrics",
                            params={"since_step": since, "limit": 10000, **({"names": names} if names else {})})
        for p in page["data"]:
            typer.echo(f"{p['step']}\t{p['name']}\t{p['value']}" + (f"\trank{p['rank']}" if p["rank"] is not None else ""))
        if not page["has_more"]:
            return
        since = page["next_since_step"]


def cancel(job_id: str) -> None:
    """Cancel a job."""
    job = _client_call("POST", f"/v1/jobs/{job_id}/cancel")
    typer.echo(f"{job['id']} {job['state']}")


def _follow(job_id: str, only_logs: bool = False) -> None:
    try:
        for event, data in Client().stream(job_id):
            if event == "log":
                typer.echo(data["text"])
            elif only_logs:
                continue
            elif event in ("state", "event"):
                typer.echo(f"[{event}] {data['type']}: {data['message']}", err=True)
            elif event == "metric":
                typer.echo(f"[metric] step {data['step']}: {data['metrics']}", err=True)
    except ClientError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from err
    job = _client_call("GET", f"/v1/jobs/{job_id}")
    typer.echo(f"{job_id} {job['state']}", err=True)
    if job["state"] != "succeeded":
        raise typer.Exit(1)

