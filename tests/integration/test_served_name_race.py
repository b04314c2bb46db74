"""A served name is unique per team in the database (``served_names``), not only in the check read before the
insert: two deployments submitted at the same instant, both past that check, end as one 201 and one 409 naming the
field, on SQLite and PostgreSQL. Names are free again once their deployment ends; migration 0011 backfills them."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import select, text

import core.jobs
import core.live_adapters
from core.db import alembic_config, get_engine, session_scope
from core.errors import ApiError
from core.jobs import create_job, transition
from core.models import Job, ServedName
from core.settings import Settings
from core.states import JobState
from core_support import fresh_postgres_database, isolated_settings, reset_postgres_database
from engine.contract.spec import parse_spec


@pytest.fixture(scope="module")
def postgres_database(postgres_url: str) -> Iterator[str]:
    with fresh_postgres_database(postgres_url, migrated=True) as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    """SQLite: a new file per test. PostgreSQL: the module's database (cloned at head), reset to that state before
    each test (a new database migrated per test took ~5.6 s at load 18, the reset ~0.1 s)."""
    if request.param == "sqlite":
        return isolated_settings(tmp_path)
    url: str = request.getfixturevalue("postgres_database")
    reset_postgres_database(url)
    return isolated_settings(tmp_path, database_url=url)


def _serve(**extra: Any) -> dict[str, Any]:
    return {"kind": "serve", "load": "base", "tokenizer_name_or_path": "tok", **extra}


def _submit(settings: Settings, raw: dict[str, Any]) -> tuple[int, str | None]:
    with session_scope(settings.database_url) as session:
        try:
            create_job(session, settings=settings, team="alpha", spec=parse_spec(raw), raw=raw)
        except ApiError as err:
            return err.status, err.field
    return 201, None


def _at_once(settings: Settings, monkeypatch: pytest.MonkeyPatch, *raws: dict[str, Any]) -> list[tuple[int, Any]]:
    """Submit ``raws`` from one thread each, every one past the Python check before any inserts (the race the
    check alone lost: it read no committed rival, so each went on to insert)."""
    checked = threading.Barrier(len(raws), timeout=30)
    first = threading.local()
    real_check = core.jobs.check_served_names

    def check_then_meet(*args: Any) -> None:
        real_check(*args)
        if not getattr(first, "done", False):  # the loser's check after its failed insert runs alone
            first.done = True
            checked.wait()

    monkeypatch.setattr(core.jobs, "check_served_names", check_then_meet)
    results: list[tuple[int, Any]] = [(0, None)] * len(raws)

    def run(i: int) -> None:
        results[i] = _submit(settings, raws[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(raws))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _rows(settings: Settings) -> list[tuple[str, str]]:
    with session_scope(settings.database_url) as session:
        return [(r.name, r.job_id) for r in session.scalars(select(ServedName).order_by(ServedName.name))]


@pytest.mark.parametrize(
    ("rival", "field"),
    [
        ({"served_model_name": "demo-chat"}, "served_model_name"),
        ({"name": "demo-chat"}, "name"),
        ({"served_model_name": "r", "lora_adapters": {"demo-chat": "a"}}, "lora_adapters.demo-chat"),
    ],
)
def test_two_submissions_at_once_one_wins(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, rival: dict[str, Any], field: str
) -> None:
    results = _at_once(settings, monkeypatch, _serve(served_model_name="demo-chat"), _serve(**rival))
    assert sorted(status for status, _ in results) == [201, 409], results
    loser = [status for status, _ in results].index(409)
    assert results[loser][1] == ["served_model_name", field][loser]  # the field of the loser's own spec
    with session_scope(settings.database_url) as session:
        live = list(session.scalars(select(Job.id).where(Job.kind == "serve")))
    assert len(live) == 1  # the loser left no job behind
    assert ("demo-chat", live[0]) in _rows(settings)


def test_a_name_is_free_again_when_its_deployment_ends(settings: Settings) -> None:
    assert _submit(settings, _serve(served_model_name="demo-chat", lora_adapters={"jazz": "a"})) == (201, None)
    assert _submit(settings, _serve(served_model_name="jazz")) == (409, "served_model_name")
    (held,) = {job for _, job in _rows(settings)}
    assert sorted(name for name, _ in _rows(settings)) == ["demo-chat", "jazz"]
    with session_scope(settings.database_url) as session:
        assert transition(session, held, JobState.cancelled)
    assert _rows(settings) == []
    assert _submit(settings, _serve(served_model_name="jazz")) == (201, None)


def test_a_name_left_by_a_job_ended_outside_transition_is_taken_over(settings: Settings) -> None:
    assert _submit(settings, _serve(served_model_name="demo-chat")) == (201, None)
    with session_scope(settings.database_url) as session:  # as a retention sweep or an older replica leaves it
        session.execute(text("UPDATE jobs SET state = 'failed'"))
    assert _submit(settings, _serve(served_model_name="demo-chat")) == (201, None)
    with session_scope(settings.database_url) as session:
        live = session.scalar(select(Job.id).where(Job.state == "queued"))
    assert _rows(settings) == [("demo-chat", live)]


def test_a_name_loaded_into_a_running_deployment_is_taken(settings: Settings) -> None:
    """An adapter loaded at run time (POST /v1/load_lora_adapter) is a served_names row only, not in any spec: a new
    deployment taking its name is the same 409 (it raised an IntegrityError twice, a 500, before)."""
    assert _submit(settings, _serve(served_model_name="demo-chat")) == (201, None)
    with session_scope(settings.database_url) as session:
        (job_id,) = session.scalars(select(Job.id))
        core.live_adapters.reserve_name(session, "alpha", "jazz", job_id)
    assert _submit(settings, _serve(served_model_name="r", lora_adapters={"jazz": "a"})) == (409, "lora_adapters.jazz")
    assert _submit(settings, _serve(served_model_name="jazz")) == (409, "served_model_name")


def test_migration_backfills_the_live_deployments_names(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    config = alembic_config(url)
    command.upgrade(config, "0010")
    jobs = [  # id, state, name, spec, created: two live ones share demo-chat (possible before 0011)
        ("old", "running", None, {"served_model_name": "demo-chat", "lora_adapters": {"jazz": "a"}}, "01"),
        ("new", "queued", "demo-chat", {}, "02"),
        ("gone", "cancelled", "ended", {}, "03"),
        ("bare", "running", None, {}, "04"),
    ]
    with get_engine(url).begin() as connection:
        for job_id, state, name, spec, day in jobs:
            connection.execute(
                text(
                    "INSERT INTO jobs (id, team, kind, name, state, spec, metadata, priority, queue, run_dir, "
                    "max_restarts, attempt_count, created_at, updated_at) VALUES (:id, 't', 'serve', :name, :state, "
                    ":spec, '{}', 0, 'q', 'r', 0, 0, :at, :at)"
                ),
                {"id": job_id, "name": name, "state": state, "spec": json.dumps(spec), "at": f"2026-01-{day} 00:00"},
            )
    command.upgrade(config, "head")
    with session_scope(url) as session:
        rows = sorted((r.name, r.job_id) for r in session.scalars(select(ServedName)))
    assert rows == [("bare", "bare"), ("demo-chat", "new"), ("jazz", "old")]
