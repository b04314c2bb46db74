"""scheduler_lock row 2: how many scheduling passes were asked for while one ran. A caller that finds the lock row
held counts an ask there instead of waiting for its own pass, and the running pass runs again when the count moved
(``core.scheduler.schedule``): at 1,000 hosts node exits came faster than passes ended and queued behind each other.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 18:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

LOCK = sa.table("scheduler_lock", sa.column("id", sa.Integer()), sa.column("generation", sa.BigInteger()))


def upgrade() -> None:
    op.bulk_insert(LOCK, [{"id": 2, "generation": 0}])


def downgrade() -> None:
    op.execute(LOCK.delete().where(LOCK.c.id == 2))
