"""Usage metering: the outbox (events waiting for the event log) and the warehouse table (one row per request).

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

from tokenfleet.store.migrations.columns import (
    COUNT,
    ID,
    NAME,
    REQUEST_ID,
    ROW_ID,
    SECONDS,
    STATUS,
    UTC_TIME,
    create_table,
    optional,
    required,
)

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    create_table(
        "usage_outbox",
        sa.Column("id", ROW_ID, autoincrement=True, nullable=False),
        *required(REQUEST_ID, "request_id"),
        *required(sa.Text(), "payload"),
        *required(UTC_TIME, "created_at"),
        *optional(UTC_TIME, "sent_at", "lease_until"),
        unique=[("request_id",)],
    )
    op.create_index("ix_usage_outbox_sent_at", "usage_outbox", ["sent_at"])
    op.create_index("ix_usage_outbox_lease_until", "usage_outbox", ["lease_until"])
    create_table(
        "usage_events",
        *required(REQUEST_ID, "request_id"),
        *required(ID, "org_id", "user_id", "key_id"),
        *required(NAME, "model", "replica"),
        *required(ID, "pool", "tier"),
        *required(COUNT, "input_tokens", "cached_tokens", "output_tokens"),
        *optional(SECONDS, "ttft_s"),
        *required(SECONDS, "latency_s", "engine_s"),
        *required(STATUS, "status"),
        *required(sa.String(500), "route"),
        *required(UTC_TIME, "started_at", "ended_at"),
        *required(sa.Date(), "day"),
        *required(UTC_TIME, "created_at"),
        key="request_id",
    )
    op.create_index("ix_usage_events_org_id_day", "usage_events", ["org_id", "day"])
    op.create_index("ix_usage_events_day", "usage_events", ["day"])


def downgrade() -> None:
    op.drop_table("usage_events")
    op.drop_table("usage_outbox")
