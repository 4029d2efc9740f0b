"""Where the gateway sends work: a replica in this process, or a replica (ours or any OpenAI-compatible server)
over HTTP. Both stream OpenAI chunk objects back and report their load."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

import httpx

from tokenfleet import tracing
from tokenfleet.api.errors import APIError
from tokenfleet.gateway.stream_client import StreamClient, UpstreamError
from tokenfleet.logs import REQUEST_ID
from tokenfleet.router.load import LoadReport, fetch_load, load_report_from

if TYPE_CHECKING:
    from tokenfleet.replica.server import ReplicaService

PATHS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}


class InProcessUpstream:
    def __init__(self, service: ReplicaService, name: str = "local") -> None:
        self.service, self.name = service, name

    async def stream(self, kind: str, body: dict) -> AsyncIterator[dict]:
        _, stream, renderer = await self.service.open(kind, {**body, "stream": True})
        async for chunk in self.service.chunks(stream, renderer, include_usage=True, continuous_usage=True):
            yield chunk

    async def load(self) -> LoadReport:
        return load_report_from(self.service.engine.state().load, time.monotonic())


class HttpUpstream:
    def __init__(
        self,
        base_url: str,
        name: str | None = None,
        kind: str = "tokenfleet",
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
    ) -> None:
        """kind: "tokenfleet" (load from GET /load) or "openai" (any OpenAI-compatible server; load from vLLM's
        /metrics). read_timeout_s bounds the wait for each next piece of a stream: a hung replica fails the
        request (which the router then continues elsewhere) instead of hanging it. Streams to an http:// replica
        go through the gateway's own StreamClient (the hot path); everything else through httpx."""
        self.base_url, self.name, self.kind = base_url.rstrip("/"), name or base_url, kind
        timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        # one connection per in-flight stream: no pool cap, or streams beyond it would queue for a connection
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, limits=limits)
        self.streams = (
            StreamClient(self.base_url, connect_timeout_s, read_timeout_s)
            if self.base_url.startswith("http://")
            else None
        )

    async def stream(self, kind: str, body: dict) -> AsyncIterator[dict]:
        # usage on every chunk, so a cancelled request is metered by what it generated
        payload = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        chunks = self._stream(kind, payload) if self.streams is not None else self._stream_httpx(kind, payload)
        try:
            async with aclosing(chunks):  # a reader that stops early closes the replica's connection now
                async for chunk in chunks:
                    yield chunk
        except (httpx.HTTPError, UpstreamError) as e:
            raise APIError(
                502, f"replica {self.name} failed: {e.__class__.__name__}", "server_error", code="upstream_error"
            ) from e

    async def _stream(self, kind: str, payload: dict) -> AsyncIterator[dict]:
        async with self.streams.post(PATHS[kind], json.dumps(payload).encode(), _request_headers()) as response:
            if response.status != 200:
                raise _replica_error(response.status, await response.read())
            async for data in sse_data(response.pieces()):
                if data != b"[DONE]":
                    yield json.loads(data)

    async def _stream_httpx(self, kind: str, payload: dict) -> AsyncIterator[dict]:
        async with self.client.stream("POST", PATHS[kind], json=payload, headers=_request_headers()) as response:
            if response.status_code != 200:
                raise _replica_error(response.status_code, await response.aread())
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])

    async def load(self) -> LoadReport:
        return await fetch_load(self.client, self.base_url, self.kind, timeout_s=2.0)

    async def prefill(self, token_ids: list[int], decode_url: str) -> dict:
        """Asks this prefill replica to compute the prompt's KV and send it to the decode replica at `decode_url`
        (replica/disagg.py); returns its account of the transfer."""
        try:
            response = await self.client.post(
                "/internal/kv/prefill", json={"prompt": token_ids, "peer": decode_url}, headers=_request_headers()
            )
        except httpx.HTTPError as e:
            raise APIError(
                502,
                f"prefill replica {self.name} failed: {e.__class__.__name__}",
                "server_error",
                code="upstream_error",
            ) from e
        if response.status_code != 200:
            raise _replica_error(response.status_code, response.content)
        return response.json()

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.streams is not None:
            await self.streams.aclose()


def _request_headers() -> dict[str, str]:
    """The request's id for the replica, so that its log lines and engine requests carry the gateway's id."""
    request_id = REQUEST_ID.get()
    headers = {"x-request-id": request_id} if request_id else {}
    tracing.inject(headers)  # and the trace the replica's spans continue (traceparent), when one is recorded
    return headers


async def sse_data(pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The payloads of the `data:` lines of an event stream, as its pieces arrive (a line may span pieces)."""
    rest = b""
    async for piece in pieces:
        lines = (rest + piece).split(b"\n") if rest else piece.split(b"\n")
        rest = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                data = line[5:].rstrip(b"\r")
                yield data[1:] if data.startswith(b" ") else data


def _replica_error(status: int, body: bytes) -> APIError:
    """A replica's 4xx passes through as it was; anything else is the replica's failure, not the client's."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": body.decode(errors="replace")[:500]}
    if 400 <= status < 500:
        return APIError(
            status,
            error.get("message", ""),
            error.get("type", "invalid_request_error"),
            error.get("param"),
            error.get("code"),
        )
    return APIError(
        502, f"replica answered {status}: {error.get('message', '')}", "server_error", code="upstream_error"
    )
