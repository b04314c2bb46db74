"""Fixtures of the security suite: isolated settings, an API client, a loopback HTTP receiver."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from security_support import Receiver, give_inputs, serve_receiver

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
    for team in ("alpha", "beta"):
        give_inputs(settings, team)
    return settings


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, reconcile=False)) as client:
        yield client
