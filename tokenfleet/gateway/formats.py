"""How a relayed stream is written as events: OpenAI chunks (`/v1/*`) or the native format of the design
document (`data: {"delta": ..., "index": i}` events, then `event: done` with usage). Resume replays the same."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tokenfleet.api.errors import APIError

Event = tuple[str, str | None]  # (data, event name)


@dataclass
class OpenAIFormat:
    kind = "openai"  # how the resume buffer names the format, to end a stream whose gateway is gone
    request_id: str
    include_usage: bool  # whether the client asked for the final usage chunk
    continuous_usage: bool = False  # ... and for usage on every chunk

    def chunk(self, chunk: dict) -> list[Event]:
        chunk["id"] = self.request_id
        if is_usage(chunk):
            if not self.include_usage:
                return []
        elif not self.continuous_usage:
            chunk.pop("usage", None)
        return [(json.dumps(chunk), None)]

    def end(self) -> list[Event]:
        return [("[DONE]", None)]

    def error(self, error: APIError) -> list[Event]:
        return [(json.dumps(error.body()), None)]

    def retrying(self, info: dict) -> list[Event]:
        """A chunk with no choices (clients skip those, like the usage chunk) under the event name `retrying`."""
        return [
            (
                json.dumps({"id": self.request_id, "object": "chat.completion.chunk", "choices": [], "retrying": info}),
                "retrying",
            )
        ]


@dataclass
class NativeFormat:
    kind = "native"
    request_id: str

    def chunk(self, chunk: dict) -> list[Event]:
        if is_usage(chunk):
            usage = chunk["usage"]
            details = usage.get("prompt_tokens_details") or {}
            return [
                (
                    json.dumps(
                        {
                            "id": self.request_id,
                            "usage": {
                                "input_tokens": usage["prompt_tokens"],
                                "cached_tokens": details.get("cached_tokens", 0),
                                "output_tokens": usage["completion_tokens"],
                            },
                        }
                    ),
                    "done",
                )
            ]
        events = []
        for choice in chunk.get("choices", []):
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

    def retrying(self, info: dict) -> list[Event]:
        return [(json.dumps(info), "retrying")]


@dataclass
class CollectFormat:
    """A non-streamed request: keeps the chunks for one aggregated response and writes no events."""

    kind = "collect"
    request_id: str
    chunks: list[dict] = field(default_factory=list)
    failure: APIError | None = None

    def chunk(self, chunk: dict) -> list[Event]:
        self.chunks.append(chunk)
        return []

    def end(self) -> list[Event]:
        return []

    def error(self, error: APIError) -> list[Event]:
        self.failure = error
        return []

    def retrying(self, info: dict) -> list[Event]:
        return []


def ending_with_error(kind: str, request_id: str, error: APIError) -> list[Event]:
    """The last events of a stream that cannot go on (its gateway died, or the resume buffer failed), in the
    stream's format: the error, then the format's end."""
    fmt = NativeFormat(request_id) if kind == NativeFormat.kind else OpenAIFormat(request_id, False)
    return fmt.error(error) + fmt.end()


def is_usage(chunk: dict) -> bool:
    return bool(chunk.get("usage")) and not chunk.get("choices")


EventFormat = OpenAIFormat | NativeFormat | CollectFormat
