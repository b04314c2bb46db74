"""Finding 7: webhook secrets are stored encrypted (Fernet, keys from settings, rotation), the migration seals rows
stored in clear before it, and API tokens stay hashed."""

from __future__ import annotations

import base64
import hashlib
import hmac
from datetime import datetime, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa
from cryptography.fernet import Fernet
from fastapi.testclient import TestClient
from security_support import Receiver, finish_job

from app.main import create_app
from core import secrets_box, webhooks
from core.db import ALEMBIC_INI, REPO_ROOT, session_scope
from core.models import ApiToken, Webhook
from core.settings import Settings
from core_support import auth, isolated_settings, make_token


def _register(settings: Settings, url: str) -> dict:
    with TestClient(create_app(settings, reconcile=False)) as client:
        answer = client.post("/v1/webhooks", json={"url": url}, headers=auth(make_token(settings, "alpha")))
        assert answer.status_code == 201, answer.text
        return answer.json()


def _stored(settings: Settings) -> str:
    with session_scope(settings.database_url) as session:
        return session.scalars(sa.select(Webhook.secret)).one()


def _signed_with(secret: str, headers: dict[str, str], body: bytes) -> bool:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    return (
        headers["webhook-signature"]
        == "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    )


def test_the_secret_is_sealed_in_the_database_and_still_signs(tmp_path: Path, receiver: Receiver) -> None:
    settings = isolated_settings(tmp_path, webhook_allowed_hosts=["127.0.0.1"], webhook_settle_s=0)
    secret = _register(settings, receiver.url)["secret"]
    stored = _stored(settings)
    assert secret.startswith("whsec_") and stored.startswith("fernet:")
    assert secret not in stored and secret.removeprefix("whsec_") not in stored
    finish_job(settings, "alpha")
    webhooks.run_once(settings)
    assert _signed_with(secret, *receiver.seen[0])


def test_keys_rotate(tmp_path: Path, receiver: Receiver) -> None:
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    settings = isolated_settings(tmp_path, webhook_allowed_hosts=["127.0.0.1"], webhook_settle_s=0, secret_keys=[old])
    secret = _register(settings, receiver.url)["secret"]
    rotated = settings.model_copy(update={"secret_keys": [new, old]})
    finish_job(rotated, "alpha")
    webhooks.run_once(rotated)  # sealed under the old key, opened by the list
    assert _signed_with(secret, *receiver.seen[0])
    resealed = secrets_box.reseal(rotated.secret_keys, _stored(settings))
    assert secrets_box.unseal([new], resealed) == secret


def test_the_migration_seals_secrets_stored_in_clear(tmp_path: Path) -> None:
    from alembic import command
    from alembic.config import Config

    url = f"sqlite:///{tmp_path / 'm.db'}"
    key = Fernet.generate_key().decode()
    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(REPO_ROOT / "migrations"))
    config.attributes.update(database_url=url, secret_keys=[key])
    command.upgrade(config, "0003")
    engine = sa.create_engine(url)
    plain = "whsec_" + base64.b64encode(b"s" * 32).decode()
    with engine.begin() as connection:
        connection.execute(
            sa.text(
                "INSERT INTO webhooks (id, team, url, secret, events, cursor, created_at) VALUES "
                "('w1', 'alpha', 'https://example.invalid/', :s, '[]', 0, :t)"
            ),
            {"s": plain, "t": datetime.now(timezone.utc)},
        )
    command.upgrade(config, "head")
    with engine.connect() as connection:
        stored = connection.execute(sa.text("SELECT secret FROM webhooks")).scalar_one()
    assert stored.startswith("fernet:") and secrets_box.unseal([key], stored) == plain
    command.downgrade(config, "0003")
    with engine.connect() as connection:
        assert connection.execute(sa.text("SELECT secret FROM webhooks")).scalar_one() == plain
    engine.dispose()
    command.upgrade(config, "head")


def test_api_tokens_stay_hashed(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path)
    token = make_token(settings, "alpha")
    with session_scope(settings.database_url) as session:
        rows = session.scalars(sa.select(ApiToken)).all()
    assert [r.token_hash for r in rows] == [hashlib.sha256(token.encode()).hexdigest()]
    assert all(token not in str(value) for r in rows for value in vars(r).values())


def test_llmjobs_reseal_moves_every_secret_to_the_newest_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from cli.main import cli

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    settings = isolated_settings(tmp_path, webhook_allowed_hosts=["127.0.0.1"], secret_keys=[old])
    secrets = [_register(settings, f"http://127.0.0.1:9/hook{i}")["secret"] for i in range(2)]
    for key, value in {
        "VAR_DIR": str(settings.var_dir),
        "DATABASE_URL": settings.database_url,
        "SECRET_KEYS": f"{new},{old}",
    }.items():
        monkeypatch.setenv(f"LLMJOBS_{key}", value)
    result = CliRunner().invoke(cli, ["reseal"])
    assert result.exit_code == 0 and "re-encrypted 2 webhook secret(s)" in result.output, result.output
    with session_scope(settings.database_url) as session:
        stored = list(session.scalars(sa.select(Webhook.secret).order_by(Webhook.url)))
    assert [secrets_box.unseal([new], s) for s in stored] == secrets  # the old key may now be dropped
    monkeypatch.setenv("LLMJOBS_SECRET_KEYS", Fernet.generate_key().decode())  # a key list that opens nothing
    refused = CliRunner().invoke(cli, ["reseal"])
    assert refused.exit_code == 1 and "open with none of secret_keys" in refused.output
    with session_scope(settings.database_url) as session:  # all or nothing: unchanged
        assert list(session.scalars(sa.select(Webhook.secret).order_by(Webhook.url))) == stored
