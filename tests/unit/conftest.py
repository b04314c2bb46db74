"""The in-process API client and a team token, over the ``settings`` fixture each API test module defines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from core.settings import Settings
from core_support import make_token
from tests.convert_tiny import real_vocab_qwen3


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, reconcile=False)) as client:
        yield client


@pytest.fixture
def token(settings: Settings) -> str:
    return make_token(settings, "alpha")


@pytest.fixture(scope="session")
def serve_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The serving tests' model: a tiny real-vocabulary Qwen3 written by transformers, its init wide enough that the
    greedy argmax has clear margins (fp32 rounding order cannot flip a token)."""
    torch.manual_seed(3)
    return real_vocab_qwen3(tmp_path_factory.mktemp("serve") / "hf", initializer_range=0.5)
