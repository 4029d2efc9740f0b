"""Tenants: organisations, their users, and API keys (only the keys' SHA-256 hashes are stored).

Revision ID: 0001
Revises: (none)
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

UTC_TIME = sa.DateTime(timezone=True)


def limit_columns() -> list[sa.Column]:
    """Per-tenant overrides of the tier's limits; NULL means the tier default."""
    return [sa.Column(name, sa.BigInteger(), nullable=True)
            for name in ("requests_per_minute", "tokens_per_minute", "concurrent_requests", "tokens_per_day")]


def upgrade() -> None:
    op.create_table(
        "organisations",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("tier", sa.String(64), nullable=False),
        *limit_columns(),
        sa.Column("provisioned_share", sa.Float(), nullable=True),
        sa.Column("created_at", UTC_TIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_organisations"),
        sa.UniqueConstraint("name", name="uq_organisations_name"),
    )
    op.create_table(
        "users",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("org_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        *limit_columns(),
        sa.Column("created_at", UTC_TIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_users"),
        sa.ForeignKeyConstraint(["org_id"], ["organisations.id"], name="fk_users_org_id_organisations"),
        sa.UniqueConstraint("org_id", "name", name="uq_users_org_id_name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("org_id", sa.String(64), nullable=False),
        sa.Column("user_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("created_at", UTC_TIME, nullable=False),
        sa.Column("revoked_at", UTC_TIME, nullable=True),
        sa.Column("last_used_at", UTC_TIME, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.ForeignKeyConstraint(["org_id"], ["organisations.id"], name="fk_api_keys_org_id_organisations"),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"], name="fk_api_keys_user_id_users"),
        sa.UniqueConstraint("hash", name="uq_api_keys_hash"),
    )
    op.create_index("ix_api_keys_org_id", "api_keys", ["org_id"])
    op.create_index("ix_api_keys_user_id", "api_keys", ["user_id"])


def downgrade() -> None:
    op.drop_table("api_keys")
    op.drop_table("users")
    op.drop_table("organisations")
