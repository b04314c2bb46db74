"""The OpenAI routes' tests: a deployment row pointing at an engine URL, and the API served by uvicorn on loopback (the
in-process TestClient cannot hold two streams open at once, nor hang up mid-answer)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from app.main import create_app
from core.db import session_scope
from core.jobs import create_job
from core.models import Event, Job
from core.settings import Settings
from engine.contract.spec import parse_spec
from service_support import free_port


def deploy(settings: Settings, team: str, name: str, url: str, load: str = "model", tokenizer: str = "tok") -> str:
    """A running serve job of ``team`` whose current attempt reported ready at ``url``; returns its id."""
    raw = {"kind": "serve", "load": load, "tokenizer_name_or_path": tokenizer, "served_model_name": name}
    with session_scope(settings.database_url) as session:
        job, _ = create_job(session, settings=settings, team=team, spec=parse_spec(raw), raw=raw)
        session.query(Job).filter(Job.id == job.id).update({"state": "running", "attempt_count": 1})
        session.add(Event(job_id=job.id, attempt=1, type="ready", data={"url": url}))
        return job.id


@contextmanager
def served(settings: Settings) -> Iterator[tuple[str, FastAPI]]:
    """(the base URL, the app) of ``create_app(settings)`` under uvicorn in a thread, lifespan included."""
    app = create_app(settings, reconcile=False)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)
