"""device leases, job nodes, scheduler lock; hosts get an address and device ids

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 18:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('address', sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column('device_ids', sa.JSON(), nullable=True))
    op.create_table('leases',
    sa.Column('id', BIG_ID, autoincrement=True, nullable=False),
    sa.Column('host', sa.String(length=255), nullable=False),
    sa.Column('device', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.String(length=36), nullable=False),
    sa.Column('team', sa.String(length=64), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('node_rank', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('host', 'device', name='uq_leases_host_device')
    )
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.create_index('ix_leases_job', ['job_id'], unique=False)
    op.create_table('job_nodes',
    sa.Column('id', BIG_ID, autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=36), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('node_rank', sa.Integer(), nullable=False),
    sa.Column('host', sa.String(length=255), nullable=False),
    sa.Column('devices', sa.JSON(), nullable=False),
    sa.Column('master_addr', sa.String(length=255), nullable=False),
    sa.Column('master_port', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('worker_pid', sa.Integer(), nullable=True),
    sa.Column('pid', sa.Integer(), nullable=True),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('released_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('job_id', 'attempt', 'node_rank', name='uq_job_nodes_attempt_rank')
    )
    with op.batch_alter_table('job_nodes', schema=None) as batch_op:
        batch_op.create_index('ix_job_nodes_host_state', ['host', 'state'], unique=False)
    lock = op.create_table('scheduler_lock',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('generation', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.bulk_insert(lock, [{'id': 1, 'generation': 0}])


def downgrade() -> None:
    op.drop_table('scheduler_lock')
    with op.batch_alter_table('job_nodes', schema=None) as batch_op:
        batch_op.drop_index('ix_job_nodes_host_state')
    op.drop_table('job_nodes')
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.drop_index('ix_leases_job')
    op.drop_table('leases')
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.drop_column('device_ids')
        batch_op.drop_column('address')
