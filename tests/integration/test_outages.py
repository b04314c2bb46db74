"""Outages: the API on a private PostgreSQL that is stopped mid-run answers 503 with the error shape, /readyz says
so, and both recover without a restart once the database is back; nothing committed before is lost. Two workers
starting at the same moment on the embedded broker both come up."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from core_support import auth, isolated_settings, make_token
from outage_support import private_postgres

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
BODY = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "in.jsonl", "output_prefix": "o"}


def test_api_answers_503_while_the_database_is_away_and_recovers(tmp_path: Path) -> None:
    with private_postgres() as pg:
        settings = isolated_settings(tmp_path, pg.url, reconcile_interval_s=1)
        (settings.data_roots[0] / "in.jsonl").write_text("{}\n")
        headers = auth(make_token(settings, "t"))
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            before = client.post("/v1/jobs", json=BODY, headers=headers)
            assert before.status_code == 201
            pg.stop()
            for path in (f"/v1/jobs/{before.json()['id']}", "/v1/jobs"):
                away = client.get(path, headers=headers)
                assert away.status_code == 503, away.text
                assert away.json()["code"] == "database_unavailable" and set(away.json()) >= {"code", "message", "field"}
                assert away.headers["retry-after"]
            assert client.post("/v1/jobs", json=BODY, headers=headers).status_code == 503
            ready = client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
            assert client.get("/healthz").status_code == 200  # the process itself is fine
            pg.start()
            deadline = time.monotonic() + 20
            while client.get("/readyz").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            again = client.get(f"/v1/jobs/{before.json()['id']}", headers=headers)
            assert again.status_code == 200 and again.json()["id"] == before.json()["id"]
            assert client.post("/v1/jobs", json=BODY, headers=headers).status_code == 201
            listed = client.get("/v1/jobs", headers=headers).json()["data"]
            assert len(listed) == 2  # the job from before the outage and the one after
