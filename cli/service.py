"""Service processes: ``serve`` (API + one local worker on the embedded defaults), ``api``, ``worker``."""

from __future__ import annotations

import subprocess
import sys
from typing import Annotated, Any

import typer

from cli.env import load_settings, prepare

SERVE_TEAM = "default"  # the team of the admin token `serve` makes; the demo lives in its data area


def admin_token(settings: Any) -> str:
    """The embedded setup's admin token: kept in <var_dir>/admin_token (mode 0600), its hash in the database."""
    from core.auth import authenticate, create_token
    from core.db import session_scope

    path = settings.var_dir / "admin_token"
    with session_scope(settings.database_url) as session:
        if path.exists() and authenticate(session, path.read_text().strip()):
            return path.read_text().strip()
        token = create_token(session, team=SERVE_TEAM, name="admin (llmjobs serve)", admin=True)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


# CPU slots of the worker `serve` starts when LLMJOBS_WORKER_DEVICES is unset: a deployment holds its slot until it
# is cancelled or idle, so one machine needs room for it, a training job and an eval (of the deployment) beside it.
SERVE_CPU_SLOTS = 3


def worker_devices(settings: Any) -> int:
    """The devices (CPU: slots) of the worker ``serve`` starts: ``LLMJOBS_WORKER_DEVICES`` when set, else
    ``SERVE_CPU_SLOTS`` on CPU (an accelerator host keeps the setting's default)."""
    if "worker_devices" in settings.model_fields_set or settings.worker_device_type != "cpu":
        return int(settings.worker_devices)
    return SERVE_CPU_SLOTS


def worker_argv(settings: Any) -> list[str]:
    return [
        sys.executable,
        "-m",
        "cli.main",
        "worker",
        "--host",
        settings.worker_name,
        "--device-type",
        settings.worker_device_type,
        "--devices",
        str(worker_devices(settings)),
    ]


def serve(
    host: Annotated[str | None, typer.Option(help="default LLMJOBS_HOST")] = None,
    port: Annotated[int | None, typer.Option(help="default LLMJOBS_PORT")] = None,
    worker: Annotated[bool, typer.Option(help="also start one local worker")] = True,
) -> None:
    """API + one local worker on the embedded defaults (what `make run` starts)."""
    from cli.demo import prepare_demo
    from core.paths import ensure_team_areas
    from engine.contract.parent_death import preexec_die_with_parent

    settings = load_settings()
    prepare(settings)
    demo = prepare_demo(ensure_team_areas(settings, SERVE_TEAM).write[0])  # relative spec paths start there
    token = admin_token(settings)
    child = None
    if worker:
        argv = worker_argv(settings)
        child = subprocess.Popen(argv, preexec_fn=preexec_die_with_parent())  # noqa: PLW1509 - only prctl, no lock
    url = f"http://{host or settings.host}:{port or settings.port}"
    typer.echo(
        f"llmjobs API:  {url}   (docs {url}/docs)\nadmin token:  {token}\n"
        f"demo data:    {demo}\ntry:          export LLMJOBS_URL={url} LLMJOBS_TOKEN={token}",
        err=True,
    )
    try:
        _uvicorn(settings, host, port)
    finally:
        if child is not None:
            child.terminate()
            try:
                child.wait(timeout=settings.cancel_grace_s + 30)  # it stops its engines and records their attempts
            except subprocess.TimeoutExpired:
                child.kill()


def _uvicorn(settings: Any, host: str | None, port: int | None) -> None:
    import uvicorn

    from app.main import create_app
    from app.timeouts import with_header_timeout
    from core import structured_logs
    from core.gc_tuning import settle_heap

    structured_logs.configure(settings.log_level, settings.log_format == "json")
    app = create_app(settings, migrate=False)
    settle_heap()  # the started app out of the collector's reach: no full collection inside a scheduling pass
    uvicorn.run(
        app,
        host=host or settings.host,
        port=port or settings.port,
        log_config=None,
        timeout_graceful_shutdown=3,
        http=with_header_timeout(settings.header_timeout_s),
    )  # uvicorn's loggers go through ours


def api(host: Annotated[str | None, typer.Option()] = None, port: Annotated[int | None, typer.Option()] = None) -> None:
    """The HTTP API only (workers run elsewhere)."""
    settings = load_settings()
    prepare(settings)
    _uvicorn(settings, host, port)


def gc() -> None:
    """Apply the retention settings once (LLMJOBS_RETENTION_*: metric points, log lines, events and run directories
    of finished jobs; LLMJOBS_METRIC_DOWNSAMPLE_ABOVE) and print what was removed as JSON."""
    import json

    from core.retention import collect

    settings = load_settings()
    prepare(settings)
    typer.echo(json.dumps(collect(settings).as_dict()))


def slurm_agent() -> None:
    """Submit and follow the jobs of the Slurm pools (LLMJOBS_SLURM_POOLS, resources.pool): run it where sbatch works
    and the service's runs_dir is on the pools' shared filesystem (a login node). Several may run; one leads."""
    from worker.slurm_agent import run_forever

    settings = load_settings()
    prepare(settings)
    if not settings.slurm_pools:
        raise typer.BadParameter("LLMJOBS_SLURM_POOLS is empty: there is no Slurm pool to serve")
    run_forever(settings)


def reseal() -> None:
    """Re-encrypt every stored webhook secret and team secret under the newest of LLMJOBS_SECRET_KEYS (after putting a
    new key first), so an old key can be dropped; prints how many. Run where the database is reachable."""
    from core import team_secrets
    from core.db import session_scope
    from core.webhooks import reseal_secrets

    settings = load_settings()
    prepare(settings)
    try:
        with session_scope(settings.database_url) as session:
            count = reseal_secrets(session, settings)
            teams = team_secrets.reseal_all(session, settings)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"re-encrypted {count} webhook secret(s) and {teams} team secret(s) under the newest key")


def worker(
    host: Annotated[str | None, typer.Option("--host", help="this host's name (default: hostname)")] = None,
    device_type: Annotated[str, typer.Option(help="cpu, cuda, npu or auto (npu, then cuda, then cpu)")] = "cpu",
    devices: Annotated[
        int | None,
        typer.Option(
            help="devices (CPU: slots) on this host; default: discovered through torch_npu / torch.cuda, 1 slot on CPU"
        ),
    ] = None,
    concurrency: Annotated[
        int | None, typer.Option(min=1, help="jobs at once (default LLMJOBS_WORKER_CONCURRENCY)")
    ] = None,
) -> None:
    """A Celery worker for one host: registers its devices, heart-beats, runs the job nodes leased to it."""
    if device_type not in ("cpu", "cuda", "npu", "auto"):
        raise typer.BadParameter("choose cpu, cuda, npu or auto", param_hint="--device-type")
    settings = load_settings()
    overrides = {"worker_name": host, "worker_concurrency": concurrency}
    settings = settings.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    prepare(settings)
    from worker.startup import inventory, run_worker

    try:
        found = inventory(settings, device_type, devices)
    except (ValueError, RuntimeError) as err:
        raise typer.BadParameter(str(err), param_hint="--device-type/--devices") from err
    run_worker(settings, found)
