"""How a relayed stream is written as events: OpenAI chunks (`/v1/*`) or the native format of the design
document (`data: {"delta": ..., "index": i}` events, then `event: done` with usage). Resume replays the same."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from tokenfleet.api.errors import APIError
from tokenfleet.api.usage import Usage
from tokenfleet.gateway.chunks import Chunk, Retrying

Event = tuple[str, str | None]  # (data, event name)


@dataclass
class OpenAIFormat:
    kind = "openai"  # how the resume buffer names the format, to end a stream whose gateway is gone
    request_id: str
    include_usage: bool  # whether the client asked for the final usage chunk
    continuous_usage: bool = False  # ... and for usage on every chunk

    def start(self) -> list[Event]:
        return []

    def chunk(self, chunk: Chunk) -> list[Event]:
        if chunk.usage_only and not self.include_usage:
            return []
        data = chunk.with_client_usage() if chunk.usage_only or self.continuous_usage else dict(chunk.data)
        data["id"] = self.request_id
        return [(json.dumps(data), None)]

    def end(self) -> list[Event]:
        return [("[DONE]", None)]

    def error(self, error: APIError) -> list[Event]:
        return [(json.dumps(error.body()), None)]

    def retrying(self, retrying: Retrying) -> list[Event]:
        """A chunk with no choices (clients skip those, like the usage chunk) under the event name `retrying`."""
        data = {"id": self.request_id, "object": "chat.completion.chunk", "choices": [], "retrying": retrying.as_dict()}
        return [(json.dumps(data), "retrying")]


@dataclass
class NativeFormat:
    kind = "native"
    request_id: str

    def start(self) -> list[Event]:
        return []

    def chunk(self, chunk: Chunk) -> list[Event]:
        if chunk.usage_only:
            return [(json.dumps({"id": self.request_id, "usage": _native_usage(chunk.usage)}), "done")]
        events = []
        for choice in chunk.choices:
            delta = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            event = {"delta": delta, "index": choice["index"]}
            if choice.get("finish_reason"):
                event["finish_reason"] = choice["finish_reason"]
            events.append((json.dumps(event), None))
        return events

    def end(self) -> list[Event]:
        return []

    def error(self, error: APIError) -> list[Event]:
        return [(json.dumps(error.body()), "error")]

    def retrying(self, retrying: Retrying) -> list[Event]:
        return [(json.dumps(retrying.as_dict()), "retrying")]


@dataclass
class CollectFormat:
    """A non-streamed request: keeps the chunks for one aggregated response and writes no events."""

    kind = "collect"
    request_id: str
    chunks: list[Chunk] = field(default_factory=list)
    failure: APIError | None = None

    def start(self) -> list[Event]:
        return []

    def chunk(self, chunk: Chunk) -> list[Event]:
        self.chunks.append(chunk)
        return []

    def end(self) -> list[Event]:
        return []

    def error(self, error: APIError) -> list[Event]:
        self.failure = error
        return []

    def retrying(self, retrying: Retrying) -> list[Event]:
        return []


def ending_with_error(kind: str, request_id: str, error: APIError) -> list[Event]:
    """The last events of a stream that cannot go on (its gateway died, or the resume buffer failed), in the
    stream's format: the error, then the format's end."""
    if kind == "responses":  # its error event; the response's last state died with the gateway that kept it
        return [
            (json.dumps({"type": "error", "code": error.code, "message": error.message, "param": error.param}), "error")
        ]
    fmt = NativeFormat(request_id) if kind == NativeFormat.kind else OpenAIFormat(request_id, False)
    return fmt.error(error) + fmt.end()


def _native_usage(usage: Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


class EventFormat(Protocol):
    """How a relay writes its request's events (OpenAIFormat, NativeFormat, CollectFormat, ResponsesFormat)."""

    @property
    def kind(self) -> str: ...  # the resume buffer's name for it, to end a stream whose gateway is gone

    def start(self) -> list[Event]: ...

    def chunk(self, chunk: Chunk) -> list[Event]: ...

    def retrying(self, retrying: Retrying) -> list[Event]: ...

    def error(self, error: APIError) -> list[Event]: ...

    def end(self) -> list[Event]: ...
