"""The in-process API client and a team token, over the ``settings`` fixture each API test module defines."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from core.settings import Settings
from core_support import make_token


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, reconcile=False)) as client:
        yield client


@pytest.fixture
def token(settings: Settings) -> str:
    return make_token(settings, "alpha")
