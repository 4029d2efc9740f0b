"""A relayed chat generation written as the Responses API's stream (`POST /v1/responses`): typed events, each
with its `sequence_number`, in OpenAI's order: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta..., then the .done events and response.completed (or
response.incomplete when it stopped on max_output_tokens, response.failed after an error). The same object keeps
the response as it grows, for a non-streamed request and for storing it."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from tokenfleet.api.errors import APIError
from tokenfleet.api.usage import Usage
from tokenfleet.gateway.chunks import Chunk, Retrying
from tokenfleet.gateway.formats import Event

FINISHED = ("completed", "incomplete", "failed", "cancelled")


@dataclass
class ResponsesFormat:
    kind = "responses"
    request_id: str  # the relay's
    response_id: str
    head: dict  # the response object's fields that the request set (model, instructions, max_output_tokens, ...)
    created_at: int = field(default_factory=lambda: int(time.time()))
    item_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    text: str = ""
    usage: Usage | None = None
    finish_reason: str | None = None
    failure: APIError | None = None
    cancelled: bool = False  # set by whoever cancels it (POST /v1/responses/{id}/cancel)
    status: str = "in_progress"
    _sequence: int = 0
    _item_open: bool = False

    def start(self) -> list[Event]:
        return [
            self._event("response.created", response=self.snapshot()),
            self._event("response.in_progress", response=self.snapshot()),
        ]

    def chunk(self, chunk: Chunk) -> list[Event]:
        self.usage = chunk.usage or self.usage
        events: list[Event] = []
        for choice in chunk.choices:
            delta = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            if delta:
                events += self._open_item()
                self.text += delta
                events.append(self._event("response.output_text.delta", **self._where(), delta=delta, logprobs=[]))
        return events

    def retrying(self, retrying: Retrying) -> list[Event]:
        return []  # the text goes on where it stopped; the Responses stream has no event for it

    def error(self, error: APIError) -> list[Event]:
        self.failure = error
        return [self._event("error", code=error.code or error.type, message=error.message, param=error.param)]

    def end(self) -> list[Event]:
        self.status = self._final_status()
        events = self._open_item()
        part = {"type": "output_text", "text": self.text, "annotations": []}
        events += [
            self._event("response.output_text.done", **self._where(), text=self.text, logprobs=[]),
            self._event("response.content_part.done", **self._where(), part=part),
            self._event("response.output_item.done", output_index=0, item=self.message_item()),
        ]
        # OpenAI has no event for a cancelled response: it ends like an incomplete one, with its status
        name = {"completed": "response.completed", "failed": "response.failed"}.get(self.status, "response.incomplete")
        return [*events, self._event(name, response=self.snapshot())]

    def snapshot(self) -> dict:
        """The response object as it stands."""
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": self._error_object(),
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            **self.head,
            "output": [self.message_item()] if self.status in FINISHED else [],
            "usage": responses_usage(self.usage) if self.status in FINISHED else None,
        }

    def message_item(self) -> dict:
        done = self.status in FINISHED
        return {
            "id": self.item_id,
            "type": "message",
            "status": "completed" if self.status == "completed" else "incomplete" if done else "in_progress",
            "role": "assistant",
            "content": [{"type": "output_text", "text": self.text, "annotations": []}] if done else [],
        }

    def _final_status(self) -> str:
        if self.failure is not None:
            return "failed"
        if self.cancelled:
            return "cancelled"
        return "completed" if self.finish_reason == "stop" else "incomplete"

    def _error_object(self) -> dict | None:
        if self.failure is None:
            return None
        return {"code": self.failure.code or "server_error", "message": self.failure.message}

    def _open_item(self) -> list[Event]:
        if self._item_open:
            return []
        self._item_open = True
        item = {"id": self.item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **self._where(), part=part),
        ]

    def _where(self) -> dict:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def _event(self, name: str, **fields: object) -> Event:
        event = {"type": name, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return json.dumps(event), name


def responses_usage(usage: Usage | None) -> dict:
    usage = usage or Usage()
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }
