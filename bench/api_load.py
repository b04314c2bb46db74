"""API latency under load: GET job and POST job against /healthz, measured in the same run on PostgreSQL.

Starts ``llmjobs api`` (uvicorn, one process, its reconciler, webhook sender and dispatcher loops running) on a
loopback port against a database of its own created on the PostgreSQL server ``--postgres`` names
(``bench.common.postgres.own_database``; dropped afterwards, never the tests' shared ``test`` database), then runs ``--clients`` concurrent clients for ``--seconds`` (or until
``--max-requests``), each cycling through ``GET /healthz``, ``GET /v1/jobs/{id}`` and ``POST /v1/jobs``. The first
``--warmup`` seconds are not counted. The baseline is /healthz: the same server, event loop, thread pool and client
doing no database work, so the ratios say what a job read or a submission adds under the same load.

Prints a human line per route and, last, one JSON object
``{"bench": "api_load", "get_p99_ratio": ..., "post_p99_ratio": ..., "errors": ...}``; targets: get ≤ 2, post ≤ 4.
The API checks a submission's paths (the input file, the tokenizer directory) at once, so the bench stages them in
the team's area first; no worker runs, so the submitted jobs only wait (the API's own dispatcher and reconciler still
schedule them). Usage: ``python bench/api_load.py [--clients 50] [--seconds 20]``; ``--smoke``: 4 clients for 2 s,
the same code path (CI runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common.postgres import DEFAULT_SERVER, own_database  # noqa: E402
from cli.env import prepare  # noqa: E402
from core.auth import create_token  # noqa: E402
from core.db import get_engine, session_scope  # noqa: E402
from core.paths import ensure_team_areas  # noqa: E402
from core.settings import Settings  # noqa: E402

ROUTES = ("healthz", "get", "post")
SPEC = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tokenizer", "output_prefix": "out/x"}


def stage(area: Path) -> None:
    """What SPEC names, in the team's area: the input file and a tokenizer directory (the API checks they exist)."""
    (area / "in.jsonl").write_text('{"text": "hello"}\n')
    (area / "tokenizer").mkdir(exist_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_api(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "cli.main", "api", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180  # a cold start (imports, migrations) took over 60 s at load 12
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the API did not start: {log.read_text()[-2000:]}")


async def timed(
    client: httpx.AsyncClient, route: str, job_id: str, spec: dict[str, Any]
) -> tuple[float, httpx.Response | None, str | None]:
    """One request of the load's mix (``route``: GET /healthz, GET /v1/jobs/{job_id} or POST /v1/jobs with
    ``spec``): its latency (ms), its answer, and what went wrong (a transport error or a status other than 200/201),
    if anything did."""
    began = time.monotonic()
    try:
        if route == "healthz":
            response = await client.get("/healthz")
        elif route == "get":
            response = await client.get(f"/v1/jobs/{job_id}")
        else:
            response = await client.post("/v1/jobs", json=spec)
    except httpx.HTTPError as err:
        return (time.monotonic() - began) * 1000, None, f"{route}: {type(err).__name__}"
    took = (time.monotonic() - began) * 1000
    if response.status_code not in (200, 201):
        return took, response, f"{route}: {response.status_code} {response.text[:200]}"
    return took, response, None


async def client_loop(
    client: httpx.AsyncClient,
    job_id: str,
    start: float,
    args: argparse.Namespace,
    shift: int,
    lat: dict[str, list[float]],
    errors: list[str],
    budget: list[int],
) -> None:
    i = shift
    while time.monotonic() - start < args.warmup + args.seconds and budget[0] > 0:
        route = ROUTES[i % len(ROUTES)]
        i += 1
        budget[0] -= 1
        counted = time.monotonic() - start >= args.warmup
        took, _, error = await timed(client, route, job_id, {**SPEC, "name": f"load-{i}"})
        if error is not None:
            errors.append(error)
        elif counted:
            lat[route].append(took)


def pct(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1] if len(values) > 1 else float("nan")
    )


async def load(
    base: str, token: str, job_id: str, args: argparse.Namespace
) -> tuple[dict[str, list[float]], list[str]]:
    lat: dict[str, list[float]] = {r: [] for r in ROUTES}
    errors: list[str] = []
    budget = [args.max_requests]
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {token}"}, limits=limits, timeout=30, trust_env=False
    ) as client:
        start = time.monotonic()
        await asyncio.gather(
            *(client_loop(client, job_id, start, args, k, lat, errors, budget) for k in range(args.clients))
        )
    return lat, errors


def run_load(args: argparse.Namespace, url: str, tmp: Path) -> tuple[dict[str, list[float]], list[str]]:
    """Start the API on ``tmp`` and the database ``url``, submit the first job, run the load; the API is stopped before the
    caller removes ``tmp`` (it writes its log and run files there until it exits)."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LLMJOBS_")},
        "LLMJOBS_VAR_DIR": str(tmp),
        "LLMJOBS_DATABASE_URL": url,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    settings = Settings(
        var_dir=tmp,
        database_url=env["LLMJOBS_DATABASE_URL"],
        broker_url="",
        redis_url=None,
        data_roots=[],
        runs_dir=None,
    )
    prepare(settings)
    area = ensure_team_areas(settings, "load").write[0]  # relative spec paths start in the team's area
    stage(area)
    with session_scope(settings.database_url) as session:
        token = create_token(session, team="load")
    port = free_port()
    proc = start_api(env, port, tmp / "api.log")
    try:
        base = f"http://127.0.0.1:{port}"
        first = httpx.post(f"{base}/v1/jobs", json=SPEC, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        if first.status_code != 201:
            raise SystemExit(f"the first submission was refused ({first.status_code}): {first.text}")
        return asyncio.run(load(base, token, first.json()["id"], args))
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument(
        "--postgres",
        default=DEFAULT_SERVER,
        help="a PostgreSQL server (the database named is only where this run creates and drops its own)",
    )
    parser.add_argument("--smoke", action="store_true", help="a seconds-long run of the same code path")
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.seconds, args.warmup = 4, 2.0, 0.5
    with own_database(args.postgres, "api") as url, tempfile.TemporaryDirectory(prefix="llmjobs-load-") as tmp:
        try:
            lat, errors = run_load(args, url, Path(tmp))
        finally:
            get_engine(url).dispose()  # this process's pooled connections, before the drop
    figures: dict[str, Any] = {"bench": "api_load", "clients": args.clients, "seconds": args.seconds}
    for route in ROUTES:
        p50, p99 = pct(lat[route], 0.5), pct(lat[route], 0.99)
        figures[f"{route}_p50_ms"], figures[f"{route}_p99_ms"] = round(p50, 1), round(p99, 1)
        figures[f"{route}_per_s"] = round(len(lat[route]) / args.seconds, 1)
        print(
            f"{route:8s} n={len(lat[route]):6d}  p50 {p50:8.1f} ms  p99 {p99:8.1f} ms  {len(lat[route]) / args.seconds:7.1f}/s"
        )
    base_p99 = figures["healthz_p99_ms"]
    figures["get_p99_ratio"] = round(figures["get_p99_ms"] / base_p99, 2)
    figures["post_p99_ratio"] = round(figures["post_p99_ms"] / base_p99, 2)
    figures["requests_per_s"] = round(sum(len(v) for v in lat.values()) / args.seconds, 1)
    figures["errors"] = len(errors)
    figures["targets_met"] = figures["get_p99_ratio"] <= 2 and figures["post_p99_ratio"] <= 4 and not errors
    for line in sorted(set(errors))[:5]:
        print("error:", line)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
