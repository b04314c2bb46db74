"""Request ids: the API echoes or makes one, the job keeps it, its broker message carries it as a header, and the
worker's JSON log lines for that job name it."""

from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path

import sqlalchemy as sa
from fastapi.testclient import TestClient

from app.main import create_app
from core.db import session_scope
from core.dispatch import dispatch_new
from core.models import Job
from core.structured_logs import HEADER, bound, json_handler
from core_support import auth, isolated_settings, make_token, team_dir


def broker_headers(broker_url: str) -> list[dict[str, str]]:
    engine = sa.create_engine(broker_url.removeprefix("sqla+"))
    with engine.connect() as connection:
        payloads = connection.execute(sa.text("SELECT payload FROM kombu_message")).scalars().all()
    engine.dispose()
    return [json.loads(p)["headers"] for p in payloads]


def test_request_id_reaches_the_job_and_its_message(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, reconcile_interval_s=600, dispatch_min_interval_s=600)
    (team_dir(settings, "t") / "in.jsonl").write_text("{}\n")
    (team_dir(settings, "t") / "tok").mkdir()  # admission wants a tokenizer directory
    body = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "o"}
    token = make_token(settings, "t")
    with TestClient(create_app(settings, reconcile=False)) as client:
        given = client.post("/v1/jobs", json=body, headers={**auth(token), "X-Request-ID": "trace-42"})
        made = client.post("/v1/jobs", json=body, headers={**auth(token), "X-Request-ID": "bad id;" + "x" * 80})
    assert given.headers["x-request-id"] == "trace-42"
    assert made.headers["x-request-id"].startswith("req_")  # an unusable caller id is replaced
    with session_scope(settings.database_url) as session:
        assert session.get(Job, given.json()["id"]).request_id == "trace-42"  # type: ignore[union-attr]
    dispatch_new(settings)  # (the dispatcher loop may have sent one already, or be sending it still)
    deadline = time.monotonic() + 10
    while len(sent := {h.get(HEADER) for h in broker_headers(settings.broker_url)}) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sent == {"trace-42", made.headers["x-request-id"]}


def test_worker_logs_carry_the_messages_request_and_job(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    settings = isolated_settings(tmp_path)
    monkeypatch.setenv("LLMJOBS_VAR_DIR", str(settings.var_dir))
    monkeypatch.setenv("LLMJOBS_DATABASE_URL", settings.database_url)
    from core.messaging import RUN_NODE_TASK
    from core.settings import clear_settings

    clear_settings()
    from worker.tasks import celery_app

    out = io.StringIO()
    handler = json_handler(out)
    logging.getLogger().addHandler(handler)
    logging.getLogger("worker").setLevel(logging.INFO)
    try:
        celery_app.tasks[RUN_NODE_TASK].apply(args=["job-1", 1, 0], headers={HEADER: "trace-7"})
    finally:
        logging.getLogger().removeHandler(handler)
        clear_settings()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    mine = [line for line in lines if line["logger"] == "worker.tasks"]
    assert mine and mine[0]["request_id"] == "trace-7" and mine[0]["job_id"] == "job-1", lines
    assert {"time", "level", "message"} <= set(mine[0])


def test_bound_ids_leave_with_the_block() -> None:
    out = io.StringIO()
    logger = logging.getLogger("llmjobs.test.bound")
    logger.addHandler(json_handler(out))
    logger.setLevel(logging.INFO)
    with bound(request_id="r1", job_id="j1"):
        logger.info("inside")
    logger.info("outside")
    inside, outside = (json.loads(line) for line in out.getvalue().splitlines())
    assert (inside["request_id"], inside["job_id"]) == ("r1", "j1")
    assert (outside["request_id"], outside["job_id"]) == (None, None)
