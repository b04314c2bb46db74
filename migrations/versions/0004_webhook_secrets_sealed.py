"""webhook secrets encrypted at rest: a wider column, and every stored secret sealed with the Fernet keys

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 15:40:00

The keys come from the caller (``app.db.upgrade_head(url, secret_keys)``), else from ``app.settings`` as the service
would read them (``core.secrets_box.keys``), and are looked up only when a row needs them. Downgrade opens every
secret again (the old code reads them in clear).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

PREFIX = "fernet:"
webhooks = sa.table("webhooks", sa.column("id", sa.String), sa.column("secret", sa.String))


def _keys() -> list[str]:
    from core.secrets_box import keys
    from core.settings import Settings

    return context.config.attributes.get("secret_keys") or keys(Settings())


def _secrets(sealed: bool) -> list[tuple[str, str]]:
    rows = op.get_bind().execute(sa.select(webhooks.c.id, webhooks.c.secret))
    return [(row_id, secret) for row_id, secret in rows if secret.startswith(PREFIX) == sealed]


def _store(row_id: str, secret: str) -> None:
    op.get_bind().execute(sa.update(webhooks).where(webhooks.c.id == row_id).values(secret=secret))


def upgrade() -> None:
    with op.batch_alter_table('webhooks') as batch:
        batch.alter_column('secret', existing_type=sa.String(length=128), type_=sa.String(length=512),
                           existing_nullable=False)
    plain = _secrets(sealed=False)
    if plain:
        from core.secrets_box import seal

        key_list = _keys()
        for row_id, secret in plain:
            _store(row_id, seal(key_list, secret))


def downgrade() -> None:
    sealed = _secrets(sealed=True)
    if sealed:
        from core.secrets_box import unseal

        key_list = _keys()
        for row_id, secret in sealed:
            _store(row_id, unseal(key_list, secret))
    with op.batch_alter_table('webhooks') as batch:
        batch.alter_column('secret', existing_type=sa.String(length=512), type_=sa.String(length=128),
                           existing_nullable=False)
