"""The ORM tables. Migrations in `migrations/versions/` create exactly this schema (a test compares them)."""

from __future__ import annotations

from datetime import UTC, date, datetime

from sqlalchemy import (
    BigInteger,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from tokenfleet.quota.limits import Limits

# Named constraints keep migrations deterministic across databases (SQLite batch migrations need the names).
NAMING = {
    "pk": "pk_%(table_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ix": "ix_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
}
NAME_LENGTH = 200


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite hands back naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class LimitColumns:
    """Per-tenant overrides of the tier's limits; NULL means "the tier default"."""

    requests_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    concurrent_requests: Mapped[int | None] = mapped_column(BigInteger)
    tokens_per_day: Mapped[int | None] = mapped_column(BigInteger)

    def limits(self) -> Limits:
        return Limits(self.requests_per_minute, self.tokens_per_minute, self.concurrent_requests, self.tokens_per_day)

    def set_limits(self, limits: Limits) -> None:
        self.requests_per_minute = limits.requests_per_minute
        self.tokens_per_minute = limits.tokens_per_minute
        self.concurrent_requests = limits.concurrent_requests
        self.tokens_per_day = limits.tokens_per_day


class Organisation(LimitColumns, Base):
    __tablename__ = "organisations"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)
    tier: Mapped[str] = mapped_column(String(64))
    provisioned_share: Mapped[float | None] = mapped_column(Float)  # fraction of provisioned throughput, 0–1
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class User(LimitColumns, Base):
    __tablename__ = "users"
    __table_args__ = (UniqueConstraint("org_id", "name"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("organisations.id"))
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    org_id: Mapped[str] = mapped_column(ForeignKey("organisations.id"), index=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id"), index=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    prefix: Mapped[str] = mapped_column(String(16))
    hash: Mapped[str] = mapped_column(String(64), unique=True)  # SHA-256 hex of the key; the key is never stored
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


# A 64-bit counter that autoincrements on both backends (SQLite only does so for a plain INTEGER primary key).
ROW_ID = BigInteger().with_variant(Integer(), "sqlite")


class UsageOutboxRow(Base):
    """A request's usage event: open while the request runs (lease_until set, refreshed by its gateway; a row
    whose lease ran out belongs to a dead gateway and is closed as failed by another), then closed and waiting to
    be shipped to the event log (sent_at NULL), then shipped (kept a while, then purged)."""

    __tablename__ = "usage_outbox"

    id: Mapped[int] = mapped_column(ROW_ID, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128), unique=True)
    payload: Mapped[str] = mapped_column(Text)  # UsageEvent.to_json()
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    sent_at: Mapped[datetime | None] = mapped_column(UTCDateTime, index=True)
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime, index=True)  # NULL once closed


class UsageEventRow(Base):
    """The warehouse: one row per request, exactly once (request_id is the key every writer inserts against)."""

    __tablename__ = "usage_events"
    __table_args__ = (Index("ix_usage_events_org_id_day", "org_id", "day"),)

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(64))
    user_id: Mapped[str] = mapped_column(String(64))
    key_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(200))
    replica: Mapped[str] = mapped_column(String(200))
    pool: Mapped[str] = mapped_column(String(64))
    tier: Mapped[str] = mapped_column(String(64))
    input_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    latency_s: Mapped[float] = mapped_column(Float)
    engine_s: Mapped[float] = mapped_column(Float)  # the request's share of its replica's busy time
    status: Mapped[str] = mapped_column(String(16))
    route: Mapped[str] = mapped_column(String(500))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime] = mapped_column(UTCDateTime)
    day: Mapped[date] = mapped_column(Date, index=True)  # UTC date of ended_at: the billing day
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)  # when the writer stored it


class ConversationRow(Base):
    """A user's conversation. No foreign key to users: an open embedded server's single user has no row there.
    updated_at moves with every message, so "newest first" is by last activity."""

    __tablename__ = "conversations"
    __table_args__ = (Index("ix_conversations_owner_updated_at", "org_id", "user_id", "updated_at", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(64))
    user_id: Mapped[str] = mapped_column(String(64))
    title: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    system_prompt: Mapped[str | None] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class MessageRow(Base):
    """One message of a conversation. An assistant reply is saved while it streams (status streaming, updated_at
    refreshed about every second), then complete, stopped or failed."""

    __tablename__ = "messages"
    __table_args__ = (
        UniqueConstraint("conversation_id", "seq"),
        Index("ix_messages_status_updated_at", "status", "updated_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id"))
    seq: Mapped[int] = mapped_column(BigInteger)  # order within the conversation; page cursors point at it
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    model: Mapped[str | None] = mapped_column(String(200))
    request_id: Mapped[str | None] = mapped_column(String(128))  # the generation writing this reply
    tokens: Mapped[int] = mapped_column(BigInteger)  # the content's tokens: counted (user) or generated (assistant)
    prompt_tokens: Mapped[int | None] = mapped_column(BigInteger)
    cached_tokens: Mapped[int | None] = mapped_column(BigInteger)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ResponseRow(Base):
    """A stored response of the Responses API (`store: true`): what came in as chat messages and what went out,
    for GET /v1/responses/{id} and for a later request's previous_response_id. Owned like conversations."""

    __tablename__ = "responses"
    __table_args__ = (Index("ix_responses_owner_created_at", "org_id", "user_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    org_id: Mapped[str] = mapped_column(String(64))
    user_id: Mapped[str] = mapped_column(String(64))
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    request_id: Mapped[str] = mapped_column(String(128))  # the generation's (x-request-id, usage rows)
    status: Mapped[str] = mapped_column(String(16))
    messages: Mapped[str] = mapped_column(Text)  # JSON: this request's input as chat messages
    body: Mapped[str] = mapped_column(Text)  # JSON: the response object as returned
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
