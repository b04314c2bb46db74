"""Helpers of the security suite: a loopback HTTP receiver, a finished job, a team's inputs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from core.db import session_scope
from core.jobs import transition
from core.settings import Settings
from core.states import JobState
from core_support import make_job, team_dir


@dataclass
class Receiver:
    """An HTTP server on 127.0.0.1 recording every POST (headers, body); it answers 200."""

    url: str = ""
    port: int = 0
    seen: list[tuple[dict[str, str], bytes]] = field(default_factory=list)


@contextmanager
def serve_receiver() -> Iterator[Receiver]:
    box = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            box.seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    box.port = server.server_address[1]
    box.url = f"http://127.0.0.1:{box.port}/hook"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield box
    server.shutdown()
    server.server_close()


def finish_job(settings: Settings, team: str) -> str:
    """A job of ``team`` that ran and succeeded (its terminal event is what webhooks announce)."""
    job_id = make_job(settings, team=team)
    with session_scope(settings.database_url) as session:
        transition(session, job_id, JobState.starting, attempt_count=1)
        transition(session, job_id, JobState.running)
        transition(session, job_id, JobState.succeeded, result={"outputs": {}})
    return job_id


def give_inputs(settings: Settings, team: str) -> Path:
    """``in.jsonl`` and a ``tok`` directory in ``team``'s data area (inputs must exist at submission); returns it."""
    area = team_dir(settings, team)
    (area / "in.jsonl").write_text('{"text": "hi"}\n')
    (area / "tok").mkdir(exist_ok=True)
    return area
