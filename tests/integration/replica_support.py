"""Helpers of the API-replica tests and of ``bench/faults.py --fault replica-kill`` (not a test module): `llmjobs api`
processes on one PostgreSQL, which of them leads, a webhook receiver that counts message ids."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, func, select, text

from core.db import session_scope
from core.models import Job, WebhookDelivery
from core.settings import Settings
from sched_support import worker_env
from service_support import free_port

# Loop intervals short enough for a test: reconciler, webhook sender, its settle time and back-off.
LOOPS = {
    "LLMJOBS_RECONCILE_INTERVAL_S": "1",
    "LLMJOBS_WEBHOOK_POLL_S": "0.3",
    "LLMJOBS_WEBHOOK_SETTLE_S": "0.5",
    "LLMJOBS_WEBHOOK_BACKOFF_S": "0.5",
    "LLMJOBS_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
}


@contextmanager
def webhook_receiver() -> Iterator[tuple[str, Counter[str]]]:
    """A local endpoint answering 200; yields its URL and how often each ``webhook-id`` arrived."""
    ids: Counter[str] = Counter()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["content-length"]))
            ids[self.headers["webhook-id"]] += 1
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", ids
    finally:
        server.shutdown()
        server.server_close()


def start_api(settings: Settings, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """An `llmjobs api` replica on a free port, once it answers /readyz; returns it and its URL."""
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "api", "--port", str(port)],
            env={**worker_env(settings), **LOOPS},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    raise AssertionError(log.read_text()[-3000:])


def stop_api(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)


def leader_pid(settings: Settings) -> int | None:
    """The OS pid of the replica that leads (its session's application_name is llmjobs-leader:<host>:<pid>)."""
    engine = create_engine(settings.database_url)
    with engine.connect() as connection:
        names = list(
            connection.scalars(
                text(
                    "SELECT application_name FROM pg_stat_activity WHERE "
                    "application_name LIKE 'llmjobs-leader:%' AND datname = current_database()"
                )
            )
        )
    engine.dispose()
    return int(names[0].rsplit(":", 1)[1]) if names else None


def wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(0.3)
    raise AssertionError(f"not {what} after {timeout}s")


def delivered_count(settings: Settings) -> int:
    with session_scope(settings.database_url) as session:
        return (
            session.scalar(
                select(func.count()).select_from(WebhookDelivery).where(WebhookDelivery.state == "delivered")
            )
            or 0
        )


def terminal(settings: Settings) -> list[Job]:
    with session_scope(settings.database_url) as session:
        return list(session.scalars(select(Job).where(Job.state.in_(["succeeded", "failed", "cancelled"]))))
