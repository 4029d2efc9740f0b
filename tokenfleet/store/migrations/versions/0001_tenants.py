"""Tenants: organisations, their users, and API keys (only the keys' SHA-256 hashes are stored).

Revision ID: 0001
Revises: (none)
"""
import sqlalchemy as sa
from alembic import op

from tokenfleet.store.migrations.columns import ID, NAME, UTC_TIME, create_table, optional, owned, required

revision = "0001"
down_revision = None

# Per-tenant overrides of the tier's limits; NULL means the tier default.
LIMITS = ("requests_per_minute", "tokens_per_minute", "concurrent_requests", "tokens_per_day")


def upgrade() -> None:
    create_table(
        "organisations",
        *required(ID, "id"),
        *required(NAME, "name"),
        *required(ID, "tier"),
        *optional(sa.BigInteger(), *LIMITS),
        *optional(sa.Float(), "provisioned_share"),
        *required(UTC_TIME, "created_at"),
        unique=[("name",)],
    )
    create_table(
        "users",
        *required(ID, "id", "org_id"),
        *required(NAME, "name"),
        *optional(sa.BigInteger(), *LIMITS),
        *required(UTC_TIME, "created_at"),
        references={"org_id": "organisations"},
        unique=[("org_id", "name")],
    )
    create_table(
        "api_keys",
        *owned(),
        *required(NAME, "name"),
        *required(sa.String(16), "prefix"),
        *required(ID, "hash"),
        *required(UTC_TIME, "created_at"),
        *optional(UTC_TIME, "revoked_at", "last_used_at"),
        references={"org_id": "organisations", "user_id": "users"},
        unique=[("hash",)],
    )
    op.create_index("ix_api_keys_org_id", "api_keys", ["org_id"])
    op.create_index("ix_api_keys_user_id", "api_keys", ["user_id"])


def downgrade() -> None:
    op.drop_table("api_keys")
    op.drop_table("users")
    op.drop_table("organisations")
