"""Settings come from LLMJOBS_* variables, with embedded defaults under the var directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from core.settings import Settings


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("LLMJOBS_")]:
        monkeypatch.delenv(name)


def test_embedded_defaults_live_under_var_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMJOBS_VAR_DIR", str(tmp_path))
    settings = Settings()
    assert settings.database_url == f"sqlite:///{tmp_path}/llmjobs.db"
    assert settings.broker_url == f"sqla+sqlite:///{tmp_path}/broker.db"
    assert settings.data_roots == [tmp_path / "data"]
    assert settings.runs_path == tmp_path / "runs"
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)


def test_environment_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMJOBS_DATABASE_URL", "postgresql+psycopg://u@db:5432/jobs")
    monkeypatch.setenv("LLMJOBS_BROKER_URL", "redis://cache:6379/1")
    monkeypatch.setenv("LLMJOBS_DATA_ROOTS", f"{tmp_path}/a, {tmp_path}/b")
    monkeypatch.setenv("LLMJOBS_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("LLMJOBS_PORT", "9001")
    settings = Settings()
    assert settings.database_url.startswith("postgresql+psycopg://")
    assert settings.broker_url == "redis://cache:6379/1"
    assert settings.data_roots == [tmp_path / "a", tmp_path / "b"]
    assert settings.runs_path == tmp_path / "runs"
    assert settings.port == 9001


def test_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMJOBS_PORT", "eighty")
    with pytest.raises(ValueError, match="port"):
        Settings()
