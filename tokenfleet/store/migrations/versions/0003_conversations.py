"""Conversations and their messages (the chat product's history).

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa
from alembic import op

from tokenfleet.store.migrations.columns import (
    COUNT,
    ID,
    NAME,
    REQUEST_ID,
    STATUS,
    UTC_TIME,
    create_table,
    optional,
    owned,
    required,
)

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    create_table(
        "conversations",
        *owned(),
        *optional(NAME, "title"),
        *optional(sa.Text(), "system_prompt"),
        *required(NAME, "model"),
        *required(UTC_TIME, "created_at", "updated_at"),
    )
    op.create_index("ix_conversations_owner_updated_at", "conversations", ["org_id", "user_id", "updated_at", "id"])
    create_table(
        "messages",
        *required(ID, "id", "conversation_id"),
        *required(COUNT, "seq"),
        *required(STATUS, "role"),
        *required(sa.Text(), "content"),
        *required(STATUS, "status"),
        *optional(sa.String(32), "finish_reason"),
        *optional(NAME, "model"),
        *optional(REQUEST_ID, "request_id"),
        *required(COUNT, "tokens"),
        *optional(COUNT, "prompt_tokens", "cached_tokens"),
        *optional(sa.Text(), "error"),
        *required(UTC_TIME, "created_at", "updated_at"),
        references={"conversation_id": "conversations"},
        unique=[("conversation_id", "seq")],
    )
    op.create_index("ix_messages_status_updated_at", "messages", ["status", "updated_at"])


def downgrade() -> None:
    op.drop_table("messages")
    op.drop_table("conversations")
