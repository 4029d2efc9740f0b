"""Stored responses of the Responses API.

Revision ID: 0004
Revises: 0003
"""
import sqlalchemy as sa
from alembic import op

from tokenfleet.store.migrations.columns import ID, REQUEST_ID, STATUS, UTC_TIME, create_table, optional, owned, required

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    create_table(
        "responses",
        *owned(),
        *optional(ID, "previous_response_id"),
        *required(REQUEST_ID, "request_id"),
        *required(STATUS, "status"),
        *required(sa.Text(), "messages", "body"),
        *required(UTC_TIME, "created_at"),
    )
    op.create_index("ix_responses_owner_created_at", "responses", ["org_id", "user_id", "created_at"])


def downgrade() -> None:
    op.drop_table("responses")
