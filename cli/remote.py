"""Remote client commands: talk to a running API at LLMJOBS_URL with LLMJOBS_TOKEN, through the SDK (``llmjobs``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import typer

from llmjobs import Client, Conflict, LlmjobsError, WaitTimeout


def _echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, ensure_ascii=False))


@contextmanager
def _api_errors() -> Iterator[None]:
    """An API error (or no answer) ends the command with exit code 1 and the API's code, message and field."""
    try:
        yield
    except LlmjobsError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from err


def submit(
    spec_file: Annotated[Path, typer.Argument(help="a job spec (JSON); - for stdin")],
    idempotency_key: Annotated[str | None, typer.Option(help="a replay with the same key returns the same job")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="stream the job until it ends")] = False,
) -> None:
    """Submit a job spec to the server."""
    text = sys.stdin.read() if str(spec_file) == "-" else spec_file.read_text()
    with _api_errors():
        job = Client().create_job(text, idempotency_key=idempotency_key)
    typer.echo(f"{job['id']} {job['state']}")
    if follow:
        _follow(job["id"])


def list_(
    state: Annotated[str | None, typer.Option(help="one state or several, comma-separated")] = None,
    kind: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option()] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="the API's page as JSON")] = False,
) -> None:
    """Your team's jobs, newest first, as a table."""
    with _api_errors():
        page = Client().jobs_page(state=state, kind=kind, limit=limit)
    if as_json:
        _echo_json(page)
        return
    rows = [
        [j["id"], j["name"] or "-", j["state"], j["kind"], _age(j["created_at"]), _progress(j)] for j in page["data"]
    ]
    _table(["ID", "NAME", "STATE", "KIND", "AGE", "PROGRESS"], rows)


def status(job_id: str, as_json: Annotated[bool, typer.Option("--json", help="the job as JSON")] = False) -> None:
    """One job: state, times, progress, error or result."""
    with _api_errors():
        job: Any = Client().get_job(job_id)
    if as_json:
        _echo_json(job)
        return
    lines = [
        ("job", f"{job['id']}  {job['name'] or ''}".rstrip()),
        ("kind", job["kind"]),
        ("state", job["state"]),
        ("created", f"{job['created_at']} ({_age(job['created_at'])} ago)"),
        ("started", job["started_at"]),
        ("finished", job["finished_at"]),
        ("waiting", job["pending_reason"]),
        ("progress", _progress(job)),
        ("estimated finish", job.get("estimated_finish")),
        ("attempts", job["attempt_count"]),
        ("slurm job", " ".join(str(v) for v in (job.get("slurm_job_id"), job.get("slurm_state")) if v)),
    ]
    for step in job.get("steps") or []:
        lines.append((f"step {step.get('name')}", f"{step.get('state')} {step.get('job_id') or ''}".rstrip()))
    if job["error"]:
        lines.append(("error", f"{job['error']['code']}: {job['error']['message']}"))
    if job["result"]:
        lines.append(("outputs", json.dumps(job["result"].get("outputs", {}), ensure_ascii=False)))
        lines.append(("summary", json.dumps(job["result"].get("summary", {}), ensure_ascii=False)))
    for key, value in lines:
        if value not in (None, "", "-"):
            typer.echo(f"{key + ':':<18}{value}")


def events(
    job_id: str,
    type: Annotated[str | None, typer.Option("--type", help="only these types, comma-separated")] = None,
) -> None:
    """A job's events, oldest first: time, type, message."""
    with _api_errors():
        for e in Client().events(job_id, types=type):
            typer.echo(f"{e['time']}  {e['type']:<11} {e['message']}")


def artifacts(job_id: str) -> None:
    """What a job wrote: name, path, size."""
    with _api_errors():
        found = Client().artifacts(job_id)
    _table(["NAME", "PATH", "BYTES"], [[a["name"], a["path"], a["size_bytes"]] for a in found])


def download(
    job_id: str,
    name: str,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="default: the file's name, or <name>.tar")
    ] = None,
    file: Annotated[str | None, typer.Option(help="one file of a directory artifact")] = None,
) -> None:
    """Download an artifact: a file as it is, a directory as a tar archive."""
    client = Client()
    with _api_errors():
        artifact = next((a for a in client.artifacts(job_id) if a["name"] == name), None)
    if artifact is None:
        typer.echo(f"error: job {job_id} has no artifact {name!r} (see llmjobs artifacts {job_id})", err=True)
        raise typer.Exit(1)
    source = Path(file or artifact["path"])
    dest = output or Path(source.name if file or Path(artifact["path"]).suffix else f"{source.name}.tar")
    with _api_errors():
        size = client.download(job_id, name, dest, file=file)
    typer.echo(f"{dest} ({size:,} bytes)")


def checkpoints(job_id: str) -> None:
    """A train job's checkpoints: iteration, format, loss at that iteration, path."""
    with _api_errors():
        found = Client().checkpoints(job_id)
    _table(
        ["ITERATION", "FORMAT", "LM_LOSS", "VAL_LM_LOSS", "LORA", "PATH"],
        [
            [
                c["iteration"],
                c["format"],
                _number(c["metrics"].get("lm_loss")),
                _number(c["metrics"].get("val_lm_loss")),
                "yes" if c["lora"] else "no",
                c["model_path"],
            ]
            for c in found
        ],
    )


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def wait(
    job_id: str, timeout: Annotated[float | None, typer.Option(help="give up after this many seconds")] = None
) -> None:
    """Wait for a job to end; the exit code is its outcome: 0 succeeded, 1 failed, 3 cancelled, 4 timed out."""
    with _api_errors():
        try:
            job = Client().wait(job_id, timeout=timeout)
        except WaitTimeout as err:  # "<id> still <state> after <timeout>s"
            typer.echo(str(err), err=True)
            raise typer.Exit(4) from err
    typer.echo(f"{job_id} {job['state']}")  # the result on stdout: `llmjobs wait ID > outcome` keeps it
    raise typer.Exit(OUTCOMES[job["state"]])


OUTCOMES = {"succeeded": 0, "failed": 1, "cancelled": 3}


def delete(
    job_id: str,
    outputs: Annotated[bool, typer.Option(help="also remove the files its artifacts list")] = False,
) -> None:
    """Delete a finished job: records and run directory (with --outputs, its output files too)."""
    with _api_errors():
        answer = Client().delete_job(job_id, outputs=outputs)
    typer.echo(f"{job_id} deleted" + "".join(f"\n  removed {p}" for p in answer["removed"]))


def _age(created: str) -> str:
    seconds = (datetime.now(timezone.utc) - _parse_time(created)).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{max(int(seconds), 0)}s"


def _parse_time(value: str) -> datetime:
    when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def _progress(job: dict[str, Any]) -> str:
    if job.get("steps"):
        done = sum(1 for s in job["steps"] if s.get("state") == "succeeded")
        return f"{done}/{len(job['steps'])} steps"
    iteration, iters = job.get("iteration"), (job.get("spec") or {}).get("train_iters")
    if iteration is not None:  # train jobs: iterations, as Megatron counts progress (tokens in `llmjobs get`)
        return f"{iteration}/{iters} iterations" if iters else f"{iteration} iterations"
    if job.get("trained_tokens") is not None:
        return f"{job['trained_tokens']:,} tokens"
    return "-"


def _table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header, *[["-" if c is None else str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def logs(
    job_id: str,
    follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
    rank: Annotated[int | None, typer.Option(help="this rank's log (default 0)")] = None,
    all_ranks: Annotated[bool, typer.Option("--all", help="the launcher's stream: every rank's output")] = False,
) -> None:
    """A job's log lines, rank 0's by default (with -f: until the job ends)."""
    stream = "launcher" if all_ranks else f"rank{rank or 0}"
    if follow:
        _follow(job_id, only_logs=True, stream=stream)
        return
    with _api_errors():
        for line in Client().logs(job_id, stream=stream):
            typer.echo(line["text"])


def metrics(job_id: str, names: Annotated[str | None, typer.Option(help="comma-separated")] = None) -> None:
    """A job's metric points, one line per point (paged by next_cursor: no point lost)."""
    count = 0
    with _api_errors():
        for p in Client().metrics(job_id, names=names):
            count += 1
            typer.echo(
                f"{p['step']}\t{p['name']}\t{p['value']}" + (f"\trank{p['rank']}" if p["rank"] is not None else "")
            )
    if not count:  # an empty answer says so (on stderr: stdout stays a clean table)
        typer.echo(f"job {job_id} has no metric points" + (f" named {names}" if names else ""), err=True)


def cancel(job_id: str) -> None:
    """Cancel a job."""
    with _api_errors():
        job = Client().cancel_job(job_id)
    typer.echo(f"{job['id']} {job['state']}")


def _follow(job_id: str, only_logs: bool = False, stream: str = "rank0") -> None:
    """Print the job's SSE stream until it ends: log lines of one ``stream`` only (the launcher's repeats every
    rank's, so showing both printed each line twice). A pipeline's steps are followed as they are submitted, their
    lines prefixed with the step's name, so its losses and logs show as a lone job's do."""
    client = Client()
    with _api_errors():
        last: str | None = None
        while (step := _print_stream(client, job_id, only_logs, stream, "", last)) is not None:
            (name, child), last = step
            _print_stream(client, child, only_logs, stream, f"[{name}] ", None)
            state = client.get_job(child)["state"]
            typer.echo(f"[{name}] {child} {state}", err=True)
        job = client.get_job(job_id)
    typer.echo(f"{job_id} {job['state']}", err=True)
    if job["state"] != "succeeded":
        raise typer.Exit(1)


def _print_stream(
    client: Client, job_id: str, only_logs: bool, stream: str, prefix: str, last: str | None
) -> tuple[tuple[str, str], str | None] | None:
    """Print ``job_id``'s stream from after ``last`` until its end (None), or until a pipeline step is submitted:
    then ((step name, its job id), the id to resume after), the parent's stream closed while the step is followed."""
    with closing(client.stream(job_id, last_event_id=last)) as messages:
        for message in messages:
            event, data = message.event, message.data
            if event == "log":
                if data.get("stream") == stream:
                    typer.echo(prefix + data["text"])
            elif only_logs:
                pass
            elif event in ("state", "event"):
                typer.echo(f"{prefix}[{event}] {data['type']}: {data['message']}", err=True)
            elif event == "metric":
                typer.echo(f"{prefix}[metric] step {data['step']}: {data['metrics']}", err=True)
            step = (data.get("data") or {}) if event == "event" and data.get("type") == "step" else {}
            if step.get("job_id"):
                return (str(step.get("step")), str(step["job_id"])), message.id
    return None


@contextmanager
def _overwrite_hint() -> Iterator[None]:
    """The API's 409 names its query parameter (overwrite=true); on the command line it is the --overwrite flag."""
    try:
        yield
    except Conflict as err:
        flag = "run again with --overwrite"
        message = err.message.replace("pass overwrite=true", flag)
        raise Conflict(
            message, err.status, err.code, err.field, err.errors, str(err).replace("pass overwrite=true", flag)
        ) from None


def upload(
    local: Annotated[Path, typer.Argument(help="a file, or a directory (every file under it, e.g. a small HF model)")],
    dest: Annotated[
        str | None, typer.Argument(help="path in your team's upload area (default: the local name)")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="replace files that exist (default: refused)")] = False,
) -> None:
    """Upload a file or a directory into your team's upload area; prints the server path to name in a spec."""
    if not local.exists():
        typer.echo(f"error: {local} does not exist", err=True)
        raise typer.Exit(1)
    client = Client()
    with _api_errors(), _overwrite_hint():
        done = (
            [client.upload(local, dest or local.name, overwrite=overwrite)]
            if local.is_file()
            else client.upload_dir(local, dest or local.resolve().name, overwrite=overwrite)
        )
    for f in done:
        typer.echo(f"{f['server_path']}  {f['size_bytes']:,} bytes  sha256 {f['sha256']}")


def files(prefix: Annotated[str | None, typer.Option(help="only under this directory")] = None) -> None:
    """Your team's uploaded files: path, size, time, server path."""
    with _api_errors():
        found = list(Client().files(prefix=prefix))
    _table(
        ["PATH", "BYTES", "MODIFIED", "SERVER_PATH"],
        [[f["path"], f["size_bytes"], f["modified_at"], f["server_path"]] for f in found],
    )


def delete_file(
    path: Annotated[str, typer.Argument(help="path in your team's upload area, as `llmjobs files` lists it")],
) -> None:
    """Delete one of your team's uploaded files."""
    with _api_errors():
        Client().delete_file(path)
    typer.echo(f"deleted {path}", err=True)
