"""Fixtures of the security suite: isolated settings, an API client, a loopback HTTP receiver."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from security_support import Receiver, serve_receiver

from app.main import create_app
from core.settings import Settings
from core_support import isolated_settings


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with serve_receiver() as box:
        yield box


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    settings = isolated_settings(tmp_path, webhook_settle_s=0, webhook_backoff_s=0.1)
    (settings.data_roots[0] / "in.jsonl").write_text('{"text": "hi"}\n')  # inputs must exist at submission
    (settings.data_roots[0] / "tok").mkdir()
    return settings


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, reconcile=False)) as client:
        yield client
