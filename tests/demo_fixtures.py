"""What the tests that run the demo through the API (``make run``'s data) start from: an isolated service whose
team ``demo`` holds what ``cli.demo.prepare_demo`` writes, and an API client with that team's token."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi.testclient import TestClient

from app.main import create_app
from cli.demo import prepare_demo
from core.settings import Settings
from core_support import auth, isolated_settings, make_token, team_dir


def demo_settings(tmp_path: Path) -> Settings:
    settings = isolated_settings(tmp_path)
    prepare_demo(team_dir(settings, "demo"))
    return settings


@contextmanager
def demo_client(settings: Settings) -> Iterator[tuple[TestClient, dict[str, str]]]:
    with TestClient(create_app(settings, reconcile=True)) as client:
        yield client, auth(make_token(settings, "demo"))
