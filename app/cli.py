"""``llmjobs``: run the service (serve, api, worker), run one job in the foreground (run), and talk to the API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from app.client import Client, ClientError

cli = typer.Typer(add_completion=False, no_args_is_help=True, help="Qwen3 fine-tuning job service.")
token_cli = typer.Typer(no_args_is_help=True, help="API tokens.")
cli.add_typer(token_cli, name="token")


def _settings():  # noqa: ANN202 - imported lazily so client commands start fast
    from app.settings import get_settings

    get_settings.cache_clear()
    return get_settings()


def _echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, ensure_ascii=False))


def _client_call(method: str, path: str, **kwargs: Any) -> Any:
    try:
        return Client().request(method, path, **kwargs)
    except ClientError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from err


# ------------------------------------------------------------------ service


def admin_token(settings: Any) -> str:
    """The embedded setup's admin token: kept in <var_dir>/admin_token (mode 0600), its hash in the database."""
    from app.auth import authenticate, create_token
    from app.db import session_scope

    path = settings.var_dir / "admin_token"
    with session_scope(settings.database_url) as session:
        if path.exists() and authenticate(session, path.read_text().strip()):
            return path.read_text().strip()
        token = create_token(session, team="default", name="admin (llmjobs serve)", admin=True)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def _prepare(settings: Any) -> None:
    from app.db import upgrade_head

    from app.secrets_box import keys

    settings.ensure_dirs()
    upgrade_head(settings.database_url, keys(settings))


@cli.command()
def serve(
    host: Annotated[Optional[str], typer.Option(help="default LLMJOBS_HOST")] = None,
    port: Annotated[Optional[int], typer.Option(help="default LLMJOBS_PORT")] = None,
    worker: Annotated[bool, typer.Option(help="also start one local worker")] = True,
) -> None:
    """API + one local worker on the embedded defaults (what `make run` starts)."""
    from app.demo import prepare_demo
    from worker.supervisor import preexec_die_with_parent

    settings = _settings()
    _prepare(settings)
    demo = prepare_demo(settings.data_roots[0])
    token = admin_token(settings)
    child = None
    if worker:
        argv = [sys.executable, "-m", "app.cli", "worker", "--host", settings.worker_name,
                "--device-type", settings.worker_device_type, "--devices", str(settings.worker_devices)]
        child = subprocess.Popen(argv, preexec_fn=preexec_die_with_parent())
    url = f"http://{host or settings.host}:{port or settings.port}"
    typer.echo(f"llmjobs API:  {url}   (docs {url}/docs)\nadmin token:  {token}\n"
               f"demo data:    {demo}\ntry:          export LLMJOBS_URL={url} LLMJOBS_TOKEN={token}", err=True)
    try:
        _uvicorn(settings, host, port)
    finally:
        if child is not None:
            child.terminate()
            try:
                child.wait(timeout=settings.cancel_grace_s + 5)
            except subprocess.TimeoutExpired:
                child.kill()


def _uvicorn(settings: Any, host: str | None, port: int | None) -> None:
    import uvicorn

    from app.main import create_app

    uvicorn.run(create_app(settings, migrate=False), host=host or settings.host, port=port or settings.port,
                log_level="info", timeout_graceful_shutdown=3)


@cli.command()
def api(host: Annotated[Optional[str], typer.Option()] = None, port: Annotated[Optional[int], typer.Option()] = None) -> None:
    """The HTTP API only (workers run elsewhere)."""
    settings = _settings()
    _prepare(settings)
    _uvicorn(settings, host, port)


@cli.command()
def worker(
    host: Annotated[Optional[str], typer.Option("--host", help="this host's name (default: hostname)")] = None,
    device_type: Annotated[str, typer.Option(help="cpu, cuda, npu or auto (npu, then cuda, then cpu)")] = "cpu",
    devices: Annotated[Optional[int], typer.Option(help="devices (CPU: slots) on this host; default: discovered "
                                                        "through torch_npu / torch.cuda, 1 slot on CPU")] = None,
    concurrency: Annotated[Optional[int], typer.Option(help="jobs at once (default LLMJOBS_WORKER_CONCURRENCY)")] = None,
) -> None:
    """A Celery worker for one host: registers its devices, heart-beats, runs the job nodes leased to it."""
    if device_type not in ("cpu", "cuda", "npu", "auto"):
        raise typer.BadParameter("choose cpu, cuda, npu or auto", param_hint="--device-type")
    configured = devices if devices is not None else (
        int(os.environ["LLMJOBS_WORKER_DEVICES"]) if os.environ.get("LLMJOBS_WORKER_DEVICES") else None)
    for key, value in (("WORKER_NAME", host), ("WORKER_CONCURRENCY", str(concurrency) if concurrency else None)):
        if value is not None:
            os.environ[f"LLMJOBS_{key}"] = value
    settings = _settings()
    _prepare(settings)
    from app.scheduler import host_queue, schedule
    from worker.celery_app import get_celery
    from worker.devices import discover, host_address
    from worker.hosts import HostHeartbeat, register_host, set_host_state
    from worker.leases import sweep_host

    try:
        inventory = discover(device_type, configured)
    except (ValueError, RuntimeError) as err:
        raise typer.BadParameter(str(err), param_hint="--device-type/--devices") from err
    name = settings.worker_name
    queues = [settings.queue_for(inventory.device_type), host_queue(name)]
    register_host(settings, name=name, device_type=inventory.device_type, devices=len(inventory.device_ids),
                  queues=queues, device_ids=inventory.device_ids, address=host_address(settings.worker_address))
    sweep_host(settings, name)  # what a previous worker on this host left: kill it, mark it lost, free the devices
    schedule(settings)
    beat = HostHeartbeat(settings, name, on_beat=lambda: (sweep_host(settings, name), schedule(settings)))
    beat.start()
    threads = max(settings.worker_concurrency, len(inventory.device_ids) + 1)  # a thread per leased node, + a pass
    try:
        get_celery(settings.broker_url).worker_main([
            "worker", "-Q", ",".join(queues), "-n", f"{name}@%h", "--pool", "threads",
            "-c", str(threads), "--loglevel", "INFO", "--without-gossip", "--without-mingle",
        ])
    finally:
        beat.stop()
        set_host_state(settings, name, "down")


@cli.command()
def run(
    spec_file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="a job spec (JSON)")],
    run_dir: Annotated[Optional[Path], typer.Option(help="default <runs_dir>/local-<time>")] = None,
) -> None:
    """Run one job in the foreground, without a server, writing the same run directory a worker would."""
    from pydantic import ValidationError

    from app.errors import validation_errors
    from worker.foreground import run_foreground

    try:
        code = run_foreground(spec_file, run_dir, _settings().runs_path)
    except ValidationError as err:
        for item in validation_errors(list(err.errors())):
            typer.echo(f"error: {spec_file}: {item['message']}", err=True)
        raise typer.Exit(2) from err
    except ValueError as err:
        typer.echo(f"error: {spec_file}: {err}", err=True)
        raise typer.Exit(2) from err
    raise typer.Exit(code)


# ------------------------------------------------------------------ client


@cli.command()
def submit(
    spec_file: Annotated[Path, typer.Argument(help="a job spec (JSON); - for stdin")],
    idempotency_key: Annotated[Optional[str], typer.Option(help="a replay with the same key returns the same job")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="stream the job until it ends")] = False,
) -> None:
    """Submit a job spec to the server."""
    text = sys.stdin.read() if str(spec_file) == "-" else spec_file.read_text()
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    job = _client_call("POST", "/v1/jobs", content=text, headers={**headers, "Content-Type": "application/json"})
    typer.echo(f"{job['id']} {job['state']}")
    if follow:
        _follow(job["id"])


@cli.command("list")
def list_(
    state: Annotated[Optional[str], typer.Option()] = None, kind: Annotated[Optional[str], typer.Option()] = None,
    limit: Annotated[int, typer.Option()] = 20,
) -> None:
    """Your team's jobs, newest first."""
    params = {k: v for k, v in {"state": state, "kind": kind, "limit": limit}.items() if v is not None}
    page = _client_call("GET", "/v1/jobs", params=params)
    for job in page["data"]:
        typer.echo(f"{job['id']}  {job['kind']:<10} {job['state']:<10} {job['created_at']}  {job['name'] or ''}")


@cli.command()
def status(job_id: str) -> None:
    """One job as JSON."""
    _echo_json(_client_call("GET", f"/v1/jobs/{job_id}"))


@cli.command()
def logs(
    job_id: str, follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
    rank: Annotated[Optional[int], typer.Option(help="a rank's own log instead of the launcher's")] = None,
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


@cli.command()
def metrics(job_id: str, names: Annotated[Optional[str], typer.Option(help="comma-separated")] = None) -> None:
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


@cli.command()
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


@token_cli.command("create")
def token_create(
    team: Annotated[str, typer.Option(help="the team whose jobs this token sees")],
    name: Annotated[Optional[str], typer.Option()] = None,
    admin: Annotated[bool, typer.Option(help="sees every team's jobs")] = False,
) -> None:
    """Create an API token (written to the database directly; printed once)."""
    from app.auth import create_token
    from app.db import session_scope

    settings = _settings()
    _prepare(settings)
    with session_scope(settings.database_url) as session:
        typer.echo(create_token(session, team=team, name=name, admin=admin))


@token_cli.command("list")
def token_list(team: Annotated[Optional[str], typer.Option(help="only this team's tokens")] = None) -> None:
    """List API tokens: id, prefix, team, name, admin, created, active or revoked."""
    from app.auth import list_tokens
    from app.db import session_scope

    settings = _settings()
    _prepare(settings)
    with session_scope(settings.database_url) as session:
        for t in list_tokens(session, team):
            typer.echo(f"{t.id}\t{t.prefix}\t{t.team}\t{t.name or '-'}\t{'admin' if t.admin else '-'}\t"
                       f"created {t.created_at:%Y-%m-%d %H:%M}\t"
                       f"{'revoked ' + format(t.revoked_at, '%Y-%m-%d %H:%M') if t.revoked_at else 'active'}")


@token_cli.command("revoke")
def token_revoke(ref: Annotated[str, typer.Argument(help="token id (from `token list`), its prefix, or the token")]) -> None:
    """Revoke an API token: requests with it are refused (401) from now on."""
    from app.auth import revoke_token
    from app.db import session_scope

    settings = _settings()
    _prepare(settings)
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


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
