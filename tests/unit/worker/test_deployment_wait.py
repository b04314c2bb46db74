"""An eval naming a deployment that is not ready at its launch (restarting, or gone) asks again with backoff before
its attempt fails, so a deployment back within the waits is used and the retries are not spent within seconds."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import insert

from core.db import session_scope
from core.models import Event
from core_support import isolated_settings, make_job, set_job_spec
from worker import node

EVAL = {"kind": "eval", "deployment": "demo-chat", "eval_data_path": "t.jsonl", "tokenizer_name_or_path": "tok"}


def test_a_deployment_back_within_the_waits_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = isolated_settings(tmp_path)
    monkeypatch.setattr(node, "DEPLOYMENT_WAITS_S", (0.2, 0.4, 0.8))
    serve = make_job(settings, team="alpha")
    with session_scope(settings.database_url) as session:
        spec = {"kind": "serve", "load": "m", "served_model_name": "demo-chat"}
        set_job_spec(session, serve, spec, state="running", attempt_count=1)
        session.commit()

    def ready() -> None:  # the deployment's engine comes up while the eval waits
        time.sleep(0.3)
        with session_scope(settings.database_url) as session:
            url = {"url": "http://127.0.0.1:9/"}
            session.execute(insert(Event), [{"job_id": serve, "type": "ready", "attempt": 1, "data": url}])
            session.commit()

    later = threading.Thread(target=ready)
    later.start()
    try:
        got = node.spec_with_deployment(settings, "alpha", EVAL)
    finally:
        later.join()
    assert got["deployment_url"] == "http://127.0.0.1:9/"


def test_a_gone_deployment_fails_the_launch_after_the_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = isolated_settings(tmp_path)
    monkeypatch.setattr(node, "DEPLOYMENT_WAITS_S", (0.1, 0.2))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="'demo-chat' is not ready \\(gone\\)"):
        node.spec_with_deployment(settings, "alpha", EVAL)
    assert time.monotonic() - started >= 0.3
