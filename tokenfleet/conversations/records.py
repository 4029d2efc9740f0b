"""What the conversation store hands out: plain frozen records (never ORM rows), and its errors."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

STREAMING, COMPLETE, STOPPED, FAILED = "streaming", "complete", "stopped", "failed"


class Conflict(Exception):
    """The request is well formed but the message's state does not allow it (a 409)."""


@dataclass(frozen=True)
class Conversation:
    id: str
    title: str | None
    system_prompt: str | None
    model: str
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class Message:
    id: str
    conversation_id: str
    seq: int
    role: str  # user | assistant
    content: str
    status: str  # streaming | complete | stopped | failed (user messages are complete)
    finish_reason: str | None  # stop | length, for a complete reply
    model: str | None  # the model that wrote a reply
    request_id: str | None  # the gateway request generating (or that generated) a reply
    tokens: int  # the content's tokens: counted for a user message, generated for a reply
    prompt_tokens: int | None
    cached_tokens: int | None
    error: str | None  # why a reply failed
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class Page:
    """One page of a listing; `next_cursor` fetches the next one, None on the last page."""

    data: list
    next_cursor: str | None


@dataclass(frozen=True)
class Outcome:
    """How a reply's generation ended, as saved on its message."""

    content: str
    status: str
    finish_reason: str | None
    tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    error: str | None
