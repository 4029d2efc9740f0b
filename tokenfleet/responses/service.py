"""Creating, reading, deleting and cancelling responses. A response is a chat completion through the gateway
(quota, tiers, fair queue, routing, failover, metering, resume exactly as for /v1/chat/completions) whose relay
writes the Responses API's events; once it ends, a `store: true` response is saved for GET and for the next
request's previous_response_id."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from tokenfleet.api.errors import APIError, bad_request, not_found
from tokenfleet.api.protocol import parse
from tokenfleet.gateway.auth import Caller
from tokenfleet.gateway.gateway import Gateway
from tokenfleet.gateway.relay import Relay
from tokenfleet.gateway.responses_format import ResponsesFormat
from tokenfleet.responses.request import ResponseCreate
from tokenfleet.responses.store import ResponseStore, StoredResponse
from tokenfleet.store.records import NotFound, Owner

log = logging.getLogger(__name__)
KEEP_RUNNING_S = 60.0  # a finished response stays readable from memory while it is being saved


@dataclass(eq=False)
class Running:
    owner: Owner
    relay: Relay
    format: ResponsesFormat
    saved: asyncio.Event  # set once it is stored (or will never be)
    deleted: bool = False


def owner_of(caller: Caller) -> Owner:
    return Owner(caller.principal.org_id, caller.principal.user_id)


class ResponseService:
    def __init__(self, gateway: Gateway, store: ResponseStore) -> None:
        self.gateway, self.store = gateway, store
        self.running: dict[str, Running] = {}
        self._tasks: set[asyncio.Task] = set()

    async def create(self, caller: Caller, body: object) -> Running:
        req = parse(ResponseCreate, body)
        assert isinstance(req, ResponseCreate)
        req.check_supported()
        owner = owner_of(caller)
        history = await self._history(owner, req.previous_response_id)
        response_id = f"resp_{uuid.uuid4().hex}"
        formats: list[ResponsesFormat] = []

        def event_format(request_id: str) -> ResponsesFormat:
            formats.append(ResponsesFormat(request_id, response_id, req.head()))
            return formats[-1]

        relay = await self.gateway.admit("chat", req.chat_body(history), caller, event_format=event_format)
        running = Running(owner, relay, formats[0], asyncio.Event())
        self.running[response_id] = running
        self._spawn(self._finish(response_id, running, req))
        return running

    async def get(self, caller: Caller, response_id: str) -> dict:
        running = self.running.get(response_id)
        if running is not None and running.owner == owner_of(caller):
            return running.format.snapshot()
        return (await self._stored(caller, response_id)).body

    async def delete(self, caller: Caller, response_id: str) -> dict:
        """Deletes a stored response; one still generating is stopped first (and never stored)."""
        owner, running = owner_of(caller), self.running.get(response_id)
        if running is not None and running.owner == owner:
            self.running.pop(response_id, None)
            running.deleted = True
            running.relay.cancel("api")
            await running.saved.wait()
        try:
            await self.store.delete(owner, response_id)
        except NotFound:
            if running is None or running.owner != owner:
                raise _no_response(response_id) from None
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, caller: Caller, response_id: str) -> dict:
        """Stops a response that is still generating; its status becomes cancelled (and so it is stored)."""
        running = self.running.get(response_id)
        if running is None or running.owner != owner_of(caller):
            await self._stored(caller, response_id)
            raise bad_request("Only a response that is still in progress can be cancelled.", param="response_id")
        if not running.relay.finished.is_set():
            running.format.cancelled = True
            running.relay.cancel("api")
            await running.relay.finished.wait()
        return running.format.snapshot()

    async def _history(self, owner: Owner, previous_response_id: str | None) -> list[dict]:
        if previous_response_id is None:
            return []
        running = self.running.get(previous_response_id)
        if running is not None and running.owner == owner:
            await running.saved.wait()  # a chain goes on from a stored turn only
        try:
            return await self.store.history(owner, previous_response_id)
        except NotFound:
            raise _no_response(previous_response_id, "previous_response_id") from None

    async def _stored(self, caller: Caller, response_id: str) -> StoredResponse:
        try:
            return await self.store.get(owner_of(caller), response_id)
        except NotFound:
            raise _no_response(response_id) from None

    async def _finish(self, response_id: str, running: Running, req: ResponseCreate) -> None:
        await running.relay.finished.wait()
        try:
            if req.store and not running.deleted:
                stored = StoredResponse(
                    response_id,
                    running.relay.request_id,
                    req.previous_response_id,
                    req.messages(),
                    running.format.snapshot(),
                )
                await self.store.save(running.owner, stored)
        except Exception:  # the response was served; only its later reads and chains miss it
            log.exception("storing response %s failed", response_id)
        finally:
            running.saved.set()
        await asyncio.sleep(KEEP_RUNNING_S)
        self.running.pop(response_id, None)

    def _spawn(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _no_response(response_id: str, param: str = "response_id") -> APIError:
    return not_found(f"No response found with id '{response_id[:80]}'.", param=param)
