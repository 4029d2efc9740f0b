"""The conversations API: conversations, their messages, and replies streamed as Server-Sent Events in the
design's format (`event: token` with {"type": "token", "text"}, then `event: done` with messageId and usage).
Every route acts for the caller's own user; another user's ids answer 404, as if they did not exist."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenfleet.api.errors import APIError, bad_request, conflict, not_found
from tokenfleet.api.http import install_error_handler, read_json, until_disconnect
from tokenfleet.api.protocol import parse
from tokenfleet.conversations.cursors import BadCursor
from tokenfleet.conversations.records import Conflict, Conversation, Message, Page
from tokenfleet.conversations.run import Run
from tokenfleet.conversations.service import ConversationService, ReplyOptions, owner_of
from tokenfleet.conversations.settings import ConversationSettings
from tokenfleet.conversations.store import ConversationStore
from tokenfleet.gateway.app import EVENT_ID
from tokenfleet.gateway.gateway import Gateway
from tokenfleet.gateway.routing import SAMPLING_FIELDS
from tokenfleet.gateway.sse_response import SSEResponse
from tokenfleet.store.db import Database
from tokenfleet.store.models import NAME_LENGTH
from tokenfleet.store.records import NotFound

# what a reply request may set besides model and max_tokens (checked by the chat API's own rules)
SAMPLING = {*SAMPLING_FIELDS, "min_tokens"}


class NewConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str | None = Field(None, max_length=NAME_LENGTH)
    system_prompt: str | None = None
    model: str | None = Field(None, min_length=1)


class ConversationChanges(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str | None = Field(None, max_length=NAME_LENGTH)


class ReplyBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = Field(None, min_length=1)
    max_tokens: int | None = Field(None, ge=1)

    def options(self) -> ReplyOptions:
        extra = dict(self.model_extra or {})
        unknown = sorted(set(extra) - SAMPLING)
        if unknown:
            raise bad_request(
                f"unknown field {unknown[0]!r}; a reply takes model, max_tokens and {', '.join(sorted(SAMPLING))}",
                param=unknown[0],
            )
        return ReplyOptions(self.model, self.max_tokens, extra)


class NewMessage(ReplyBody):
    content: str


def _unix(moment: datetime) -> int:
    return int(moment.timestamp())


def conversation_json(c: Conversation) -> dict:
    return {
        "id": c.id,
        "object": "conversation",
        "title": c.title,
        "model": c.model,
        "system_prompt": c.system_prompt,
        "created_at": _unix(c.created_at),
        "updated_at": _unix(c.updated_at),
    }


def message_json(m: Message) -> dict:
    body = {
        "id": m.id,
        "object": "conversation.message",
        "conversation_id": m.conversation_id,
        "role": m.role,
        "content": m.content,
        "status": m.status,
        "tokens": m.tokens,
        "created_at": _unix(m.created_at),
        "updated_at": _unix(m.updated_at),
    }
    if m.role == "assistant":
        body.update(
            finish_reason=m.finish_reason,
            model=m.model,
            request_id=m.request_id,
            error=m.error,
            usage={"input": m.prompt_tokens or 0, "output": m.tokens, "cached": m.cached_tokens or 0},
        )
    return body


def page_json(page: Page, item_json: Callable[[Any], dict]) -> dict:
    """A listing's page as the API shows it: its items through `item_json`, and the cursor of the next page."""
    data = [item_json(item) for item in page.data]
    return {"object": "list", "data": data, "has_more": page.next_cursor is not None, "next_cursor": page.next_cursor}


@contextmanager
def conversation_errors() -> Iterator[None]:
    try:
        yield
    except NotFound as e:
        raise not_found(str(e), code="not_found") from None
    except Conflict as e:
        raise conflict(str(e), code="conflict") from None
    except BadCursor as e:
        raise bad_request(str(e), param="cursor") from None


def add_conversation_routes(
    app: FastAPI, gateway: Gateway, db: Database, settings: ConversationSettings | None = None
) -> ConversationService:
    """Installs the routes, and on the gateway the sweep for replies a dead gateway left streaming (a service) and
    the shutdown that saves replies still generating (before the database closes)."""
    settings = settings or ConversationSettings()
    service = ConversationService(gateway, ConversationStore(db, settings.stale_after_s), settings)
    gateway.services.append(service.sweep_stale)
    gateway.closers.insert(0, service.close)
    install_error_handler(app)
    _conversation_routes(app, gateway, service)
    _message_routes(app, gateway, service)
    _reply_routes(app, gateway, service)
    return service


async def _optional_json(request: Request) -> object:
    """The body, or {} when there is none (every field of these requests is optional)."""
    return await read_json(request) if await request.body() else {}


def _limit(request: Request, settings: ConversationSettings) -> int:
    raw = request.query_params.get("limit", "20")
    if not re.fullmatch(r"[0-9]{1,6}", raw) or not 1 <= int(raw) <= settings.max_page:
        raise bad_request(f"limit must be a whole number from 1 to {settings.max_page}", param="limit")
    return int(raw)


def _check_text(text: str | None, what: str, limit: int) -> None:
    """Text the database can store: not too long, no NUL characters, no lone surrogates (JSON allows both)."""
    if text is None:
        return
    if len(text) > limit:
        raise APIError(
            413, f"the {what} is {len(text)} characters long; the most is {limit}", param=what, code="message_too_large"
        )
    if "\x00" in text:
        raise bad_request(f"the {what} contains a NUL character", param=what)
    try:
        text.encode()
    except UnicodeEncodeError:
        raise bad_request(f"the {what} is not valid Unicode (it has a lone surrogate)", param=what) from None


def _conversation_routes(app: FastAPI, gateway: Gateway, service: ConversationService) -> None:
    store, settings = service.store, service.settings

    @app.post("/v1/conversations", status_code=201)
    async def create(request: Request) -> JSONResponse:
        caller = await gateway.auth.caller(request)
        body = parse(NewConversation, await _optional_json(request))
        _check_text(body.system_prompt, "system_prompt", settings.max_message_chars)
        _check_text(body.title, "title", NAME_LENGTH)
        model = body.model or service.default_model()
        service.model_info(model)  # 404 for an unknown model
        conv = await store.create(owner_of(caller), model, body.title or None, body.system_prompt or None)
        return JSONResponse(conversation_json(conv), status_code=201)

    @app.get("/v1/conversations")
    async def list_conversations(request: Request) -> dict:
        caller = await gateway.auth.caller(request)
        with conversation_errors():
            page = await store.list_conversations(
                owner_of(caller), _limit(request, settings), request.query_params.get("cursor")
            )
        return page_json(page, conversation_json)

    @app.get("/v1/conversations/{conversation_id}")
    async def get(conversation_id: str, request: Request) -> dict:
        caller = await gateway.auth.caller(request)
        with conversation_errors():
            return conversation_json(await store.get(owner_of(caller), conversation_id))

    @app.patch("/v1/conversations/{conversation_id}")
    async def rename(conversation_id: str, request: Request) -> dict:
        caller = await gateway.auth.caller(request)
        body = parse(ConversationChanges, await read_json(request))
        _check_text(body.title, "title", NAME_LENGTH)
        with conversation_errors():
            return conversation_json(await store.set_title(owner_of(caller), conversation_id, body.title or None))

    @app.delete("/v1/conversations/{conversation_id}")
    async def delete(conversation_id: str, request: Request) -> dict:
        caller = await gateway.auth.caller(request)
        with conversation_errors():
            await service.delete(caller, conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


def _message_routes(app: FastAPI, gateway: Gateway, service: ConversationService) -> None:
    store, settings = service.store, service.settings

    @app.get("/v1/conversations/{conversation_id}/messages")
    async def messages(conversation_id: str, request: Request) -> dict:
        """Newest first by default (order=asc for oldest first); next_cursor fetches the following page."""
        caller = await gateway.auth.caller(request)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be asc or desc", param="order")
        with conversation_errors():
            page = await store.messages(
                owner_of(caller),
                conversation_id,
                _limit(request, settings),
                request.query_params.get("cursor"),
                newest_first=order == "desc",
            )
        return page_json(page, message_json)

    @app.get("/v1/messages/{message_id}")
    async def message(message_id: str, request: Request) -> dict:
        caller = await gateway.auth.caller(request)
        with conversation_errors():
            return message_json(await store.message(owner_of(caller), message_id))

    @app.post("/v1/messages/{message_id}/stop")
    async def stop(message_id: str, request: Request) -> dict:
        caller = await gateway.auth.caller(request)
        with conversation_errors():
            return message_json(await service.stop(caller, message_id))


def _reply_routes(app: FastAPI, gateway: Gateway, service: ConversationService) -> None:
    settings = service.settings

    @app.post("/v1/conversations/{conversation_id}/messages")
    async def send(conversation_id: str, request: Request) -> SSEResponse:
        caller = await gateway.auth.caller(request)
        body = parse(NewMessage, await read_json(request))
        if not body.content.strip():
            raise bad_request("content must not be empty", param="content")
        _check_text(body.content, "content", settings.max_message_chars)
        with conversation_errors():
            # a client that leaves while its request waits for room gives the room back; once it runs, the reply
            # goes on (and is saved) whether the client stays or not
            _, run = await until_disconnect(
                request, service.send(caller, conversation_id, body.content, body.options())
            )
        return reply_stream(gateway, run)

    async def redo(message_id: str, request: Request, continuing: bool) -> SSEResponse:
        caller = await gateway.auth.caller(request)
        options = parse(ReplyBody, await _optional_json(request)).options()
        with conversation_errors():
            run = await until_disconnect(request, service.redo(caller, message_id, continuing, options))
        return reply_stream(gateway, run)

    @app.get("/v1/messages/{message_id}/stream")
    async def follow(message_id: str, request: Request) -> SSEResponse:
        """A reply generating on this gateway, from after Last-Event-ID (the ids its stream was sent with), so a
        dropped connection or a refresh goes on without losing or repeating text. x-reply-prefix-length: how many
        characters of the saved text came before this generation (continue), the rest being its tokens."""
        caller = await gateway.auth.caller(request)
        after = _last_event_id(request)
        with conversation_errors():
            message = await service.store.message(owner_of(caller), message_id)  # 404 for anyone else's
        run = service.runs.get(message.id)
        if run is None:  # finished, or generating on another gateway of the fleet
            raise conflict(
                f"message {message_id} is not generating on this gateway (status {message.status}); "
                f"read it with GET /v1/messages/{message_id}",
                code="reply_not_live",
            )
        return reply_stream(gateway, run, after)

    @app.post("/v1/messages/{message_id}/regenerate")
    async def regenerate(message_id: str, request: Request) -> SSEResponse:
        return await redo(message_id, request, continuing=False)

    @app.post("/v1/messages/{message_id}/continue")
    async def continue_(message_id: str, request: Request) -> SSEResponse:
        return await redo(message_id, request, continuing=True)


def _last_event_id(request: Request) -> int:
    last = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
    if not EVENT_ID.fullmatch(last):
        raise bad_request(
            "Last-Event-ID must be the integer id of an event (ASCII digits, at most 18)", param="Last-Event-ID"
        )
    return int(last)


def reply_stream(gateway: Gateway, run: Run, after: int = 0) -> SSEResponse:
    """The reply's events after event `after` (from its start: `start`, `token`..., `done`), with the gateway's
    heartbeats and send timeout. A client that hangs up only ends its own connection."""
    headers = {
        "x-request-id": run.request_id,
        "x-conversation-id": run.conversation_id,
        "x-message-id": run.message_id,
        "x-reply-prefix-length": str(len(run.prefix)),
    }
    follower = run.follow()
    follower.position = min(after, len(run.events))
    return SSEResponse(
        follower,
        headers,
        gateway.settings.ping_interval_s,
        gateway.settings.send_timeout_s,
        lambda how: gateway.metrics.stream_endings.labels(how).inc(),
    )
