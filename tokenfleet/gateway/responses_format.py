"""A relayed chat generation written as the Responses API's stream (`POST /v1/responses`): typed events, each
with its `sequence_number`, in OpenAI's order: response.created, response.in_progress, then each output item in
turn (the model's thinking, for templates that think: a reasoning item whose one content part is its text,
response.output_item.added, response.content_part.added, response.reasoning_text.delta...,
response.reasoning_text.done, response.content_part.done, response.output_item.done; a message: the same with
response.output_text.delta... and response.output_text.done; a function call:
response.output_item.added, response.function_call_arguments.delta..., response.function_call_arguments.done,
response.output_item.done), and response.completed (or response.incomplete when it stopped on
max_output_tokens, response.failed after an error). The same object keeps the response as it grows, for a
non-streamed request and for storing it."""

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
STOPPED = ("stop", "tool_calls")  # finish reasons of a response that completed


@dataclass
class _Item:
    """One output item: the model's reasoning or the message (their text), or a function call (its arguments)."""

    kind: str  # "reasoning" | "message" | "function_call"
    id: str
    text: str = ""
    call_id: str = ""
    name: str = ""
    done: bool = False

    def body(self, status: str) -> dict:
        if self.kind == "function_call":
            return {
                "id": self.id,
                "type": "function_call",
                "status": status,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": self.text,
            }
        content = [] if status == "in_progress" else [self.part()]
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "status": status, "summary": [], "content": content}
        return {"id": self.id, "type": "message", "status": status, "role": "assistant", "content": content}

    def part(self, text: str | None = None) -> dict:
        """The item's one content part (its reasoning text, or the message's output text)."""
        text = self.text if text is None else text
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": []}

    @property
    def has_text(self) -> bool:
        return self.kind in ("reasoning", "message")


@dataclass
class ResponsesFormat:
    kind = "responses"
    request_id: str  # the relay's
    response_id: str
    head: dict  # the response object's fields that the request set (model, instructions, max_output_tokens, ...)
    created_at: int = field(default_factory=lambda: int(time.time()))
    items: list[_Item] = field(default_factory=list)
    usage: Usage | None = None
    finish_reason: str | None = None
    failure: APIError | None = None
    cancelled: bool = False  # set by whoever cancels it (POST /v1/responses/{id}/cancel)
    status: str = "in_progress"
    _sequence: int = 0
    _calls: dict[int, int] = field(default_factory=dict)  # the chat's tool call index -> its output index

    @property
    def text(self) -> str:
        return "".join(item.text for item in self.items if item.kind == "message")

    def start(self) -> list[Event]:
        return [
            self._event("response.created", response=self.snapshot()),
            self._event("response.in_progress", response=self.snapshot()),
        ]

    def chunk(self, chunk: Chunk) -> list[Event]:
        self.usage = chunk.usage or self.usage
        events: list[Event] = []
        for choice in chunk.choices:
            delta = choice.get("delta") or {}
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            if reasoning:
                events += self._text("reasoning", reasoning)
            text = delta.get("content") or choice.get("text") or ""
            if text:
                events += self._text("message", text)
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
        return events

    def retrying(self, retrying: Retrying) -> list[Event]:
        return []  # the text goes on where it stopped; the Responses stream has no event for it

    def error(self, error: APIError) -> list[Event]:
        self.failure = error
        return [self._event("error", code=error.code or error.type, message=error.message, param=error.param)]

    def end(self) -> list[Event]:
        self.status = self._final_status()
        events = [] if self.items else self._open(_Item("message", _new_id("msg")))
        events += self._close()
        # OpenAI has no event for a cancelled response: it ends like an incomplete one, with its status
        name = {"completed": "response.completed", "failed": "response.failed"}.get(self.status, "response.incomplete")
        return [*events, self._event(name, response=self.snapshot())]

    def snapshot(self) -> dict:
        """The response object as it stands."""
        finished = self.status in FINISHED
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": self._error_object(),
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            **self.head,
            "output": [item.body(self._item_status(item)) for item in self.items] if finished else [],
            "usage": responses_usage(self.usage) if finished else None,
        }

    # --- items --------------------------------------------------------------------------------------------------

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        current = self.items[-1] if self.items else None
        if current is None or current.kind != kind or current.done:
            events += self._close()
            current = _Item(kind, _new_id("rs" if kind == "reasoning" else "msg"))
            events += self._open(current)
        current.text += text
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **self._where(), delta=text))
        else:
            events.append(self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[]))
        return events

    def _call(self, call: dict) -> list[Event]:
        events: list[Event] = []
        function = call.get("function") or {}
        index = call.get("index", 0)
        if call.get("id") is not None and index not in self._calls:
            events += self._close()
            events += self._open(
                _Item("function_call", _new_id("fc"), call_id=call["id"], name=function.get("name") or "")
            )
            self._calls[index] = len(self.items) - 1
        position = self._calls.get(index)
        arguments = function.get("arguments") or ""
        if position is not None and arguments:
            item = self.items[position]
            item.text += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta", item_id=item.id, output_index=position, delta=arguments
                )
            )
        return events

    def _open(self, item: _Item) -> list[Event]:
        self.items.append(item)
        position = len(self.items) - 1
        events = [self._event("response.output_item.added", output_index=position, item=item.body("in_progress"))]
        if item.has_text:
            events.append(self._event("response.content_part.added", **self._where(), part=item.part("")))
        return events

    def _close(self) -> list[Event]:
        """The .done events of the item being written, if one is."""
        if not self.items or self.items[-1].done:
            return []
        item, position = self.items[-1], len(self.items) - 1
        item.done = True
        status = self._item_status(item)
        if item.kind == "function_call":
            events = [
                self._event(
                    "response.function_call_arguments.done", item_id=item.id, output_index=position, arguments=item.text
                )
            ]
        else:
            text_done = (
                self._event("response.reasoning_text.done", **self._where(), text=item.text)
                if item.kind == "reasoning"
                else self._event("response.output_text.done", **self._where(), text=item.text, logprobs=[])
            )
            events = [text_done, self._event("response.content_part.done", **self._where(), part=item.part())]
        return [*events, self._event("response.output_item.done", output_index=position, item=item.body(status))]

    def _item_status(self, item: _Item) -> str:
        """An item that the response went on past is complete; the last one shares the response's fate."""
        if self.status not in FINISHED:
            return "completed" if item.done else "in_progress"
        if item is not self.items[-1] or self.status == "completed":
            return "completed"
        return "incomplete"

    def _final_status(self) -> str:
        if self.failure is not None:
            return "failed"
        if self.cancelled:
            return "cancelled"
        return "completed" if self.finish_reason in STOPPED else "incomplete"

    def _error_object(self) -> dict | None:
        if self.failure is None:
            return None
        return {"code": self.failure.code or "server_error", "message": self.failure.message}

    def _where(self) -> dict:
        """The item being written (reasoning or message), its one content part."""
        return {"item_id": self.items[-1].id, "output_index": len(self.items) - 1, "content_index": 0}

    def _event(self, name: str, **fields: object) -> Event:
        event = {"type": name, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return json.dumps(event), name


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(usage: Usage | None) -> dict:
    usage = usage or Usage()
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }
