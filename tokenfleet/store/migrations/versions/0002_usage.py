"""Usage metering: the outbox (events waiting for the event log) and the warehouse table (one row per request).

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

UTC_TIME = sa.DateTime(timezone=True)
ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements only a plain INTEGER key


def upgrade() -> None:
    op.create_table(
        "usage_outbox",
        sa.Column("id", ROW_ID, autoincrement=True, nullable=False),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("created_at", UTC_TIME, nullable=False),
        sa.Column("sent_at", UTC_TIME, nullable=True),
        sa.Column("lease_until", UTC_TIME, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_usage_outbox"),
        sa.UniqueConstraint("request_id", name="uq_usage_outbox_request_id"),
    )
    op.create_index("ix_usage_outbox_sent_at", "usage_outbox", ["sent_at"])
    op.create_index("ix_usage_outbox_lease_until", "usage_outbox", ["lease_until"])
    op.create_table(
        "usage_events",
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("org_id", sa.String(64), nullable=False),
        sa.Column("user_id", sa.String(64), nullable=False),
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("replica", sa.String(200), nullable=False),
        sa.Column("pool", sa.String(64), nullable=False),
        sa.Column("tier", sa.String(64), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("latency_s", sa.Float(), nullable=False),
        sa.Column("engine_s", sa.Float(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("route", sa.String(500), nullable=False),
        sa.Column("started_at", UTC_TIME, nullable=False),
        sa.Column("ended_at", UTC_TIME, nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("created_at", UTC_TIME, nullable=False),
        sa.PrimaryKeyConstraint("request_id", name="pk_usage_events"),
    )
    op.create_index("ix_usage_events_org_id_day", "usage_events", ["org_id", "day"])
    op.create_index("ix_usage_events_day", "usage_events", ["day"])


def downgrade() -> None:
    op.drop_table("usage_events")
    op.drop_table("usage_outbox")
