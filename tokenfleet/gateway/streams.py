"""The read side of the requests a gateway relays: a client following a stream (from its start or from any event
on, when it resumes), a non-streamed request waiting for its whole response, resume tokens, who may resume, and
cancelling. Generation itself runs in the relays (relay.py), whatever the readers do."""

from __future__ import annotations

import asyncio
import hashlib
import hmac

from tokenfleet.api.errors import not_found
from tokenfleet.gateway.aggregate import aggregate
from tokenfleet.gateway.auth import Caller
from tokenfleet.gateway.formats import CollectFormat
from tokenfleet.gateway.metrics import GatewayMetrics
from tokenfleet.gateway.relay import Relay
from tokenfleet.gateway.resume import ResumeBuffer
from tokenfleet.gateway.settings import StreamSettings
from tokenfleet.gateway.sse_response import SSEResponse


class Streams:
    def __init__(
        self,
        relays: dict[str, Relay],
        buffer: ResumeBuffer,
        settings: StreamSettings,
        metrics: GatewayMetrics,
        resume_secret: bytes,
    ) -> None:
        """`relays`: the gateway's running (and recently finished) relays by request id, shared with it."""
        self.relays, self.buffer, self.settings, self.metrics = relays, buffer, settings, metrics
        self.resume_secret = resume_secret

    def sse(
        self, request_id: str, after: int, headers: dict[str, str] | None = None, event_ids: bool = True
    ) -> SSEResponse:
        """The stream from event `after` on; `event_ids`: each event with its `id:` and name (a resumable stream),
        else only OpenAI's `data:` lines."""
        relay = self.relays.get(request_id)
        behind = None
        if relay is not None:
            relay.reader_joined()
            limit = self.settings.max_lag_events
            behind = lambda event_id: relay.written_id - event_id > limit  # noqa: E731

        def on_end(how: str) -> None:
            self.metrics.stream_endings.labels(how).inc()
            if relay is not None:
                relay.reader_left(disconnected=how == "disconnect")

        return SSEResponse(
            self.buffer.follow(request_id, after),
            {**(headers or {}), "x-request-id": request_id},
            self.settings.ping_interval_s,
            self.settings.send_timeout_s,
            on_end,
            behind,
            event_ids,
        )

    async def complete(self, relay: Relay, kind: str) -> dict:
        """A non-streamed request: wait for the whole generation (cancelled if the client leaves), then answer."""
        try:
            await asyncio.shield(relay.finished.wait())
        except asyncio.CancelledError:
            relay.cancel("disconnect")
            raise
        fmt = relay.format
        assert isinstance(fmt, CollectFormat)
        if fmt.failure is not None:
            raise fmt.failure
        response = aggregate(fmt.chunks, kind)
        response["id"] = relay.request_id
        return response

    def resume_token(self, request_id: str, owner: str) -> str:
        return hmac.new(self.resume_secret, f"{request_id}/{owner}".encode(), hashlib.sha256).hexdigest()

    async def check_resumable(self, request_id: str, token: str | None, tenant: str | None) -> None:
        """Only the tenant that made a request may resume it (`tenant`, from its API key, or the stream's resume
        `token`); anyone else learns nothing, not even that the stream exists."""
        owner = await self.buffer.owner(request_id)
        if owner is not None and token is not None:
            # compare_digest refuses non-ASCII text with a TypeError; no token of ours has any
            allowed = token.isascii() and hmac.compare_digest(token, self.resume_token(request_id, owner))
        else:
            allowed = owner is not None and owner == tenant
        if not allowed:
            raise not_found(
                f"no stream {request_id!r} to resume (streams are kept for a few minutes)", param="request_id"
            )

    def cancel(self, request_id: str, caller: Caller) -> bool:
        relay = self.relays.get(request_id)
        if relay is None or relay.owner != caller.tenant:
            raise not_found(
                f"no request {request_id!r} (finished requests are kept for a few minutes)", param="request_id"
            )
        return relay.cancel("api")
