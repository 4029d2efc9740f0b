"""Folds streamed chunks back into the one response object a non-streaming client asked for: the content and
reasoning deltas joined, each tool call (by its index) made of its first delta's id and name and all its arguments'
pieces, and OpenAI's null content for a message that only calls tools. A call whose arguments never became a JSON
object (the output ended half way through it, or broke) is left out, as a replica leaves it out of a whole
message: a stream sends such a call's text again as content."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tokenfleet.api.usage import Usage
from tokenfleet.gateway.chunks import Chunk


@dataclass
class _CallParts:
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    @property
    def complete(self) -> bool:
        try:
            return isinstance(json.loads(self.arguments), dict)
        except json.JSONDecodeError:
            return False


@dataclass
class _Choice:
    body: dict
    calls: dict[int, _CallParts] = field(default_factory=dict)


def aggregate(chunks: list[Chunk], kind: str) -> dict:
    """chat.completion.chunk / text_completion chunks -> chat.completion / text_completion."""
    choices: dict[int, _Choice] = {}
    usage: Usage | None = None
    head = chunks[0].data if chunks else {}
    for chunk in chunks:
        usage = chunk.usage or usage
        for part in chunk.choices:
            index = part["index"]
            _merge(choices.setdefault(index, _Choice(_empty(index, kind))), part, kind)
    return {
        "id": head.get("id"),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": head.get("created"),
        "model": head.get("model"),
        "choices": [_finished(choices[i]) for i in sorted(choices)],
        "usage": usage.for_client() if usage is not None else None,
    }


def _empty(index: int, kind: str) -> dict:
    choice: dict[str, object] = {"index": index, "logprobs": None, "finish_reason": None}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": ""}
    else:
        choice["text"] = ""
    return choice


def _merge(choice: _Choice, part: dict, kind: str) -> None:
    body = choice.body
    if kind == "chat":
        _merge_delta(choice, part.get("delta") or {})
    else:
        body["text"] += part.get("text") or ""
    if part.get("finish_reason"):
        body["finish_reason"] = part["finish_reason"]
    if part.get("logprobs"):
        body["logprobs"] = _merge_logprobs(body["logprobs"], part["logprobs"])


def _merge_delta(choice: _Choice, delta: dict) -> None:
    message = choice.body["message"]
    message["content"] += delta.get("content") or ""
    if delta.get("reasoning_content"):
        message["reasoning_content"] = message.get("reasoning_content", "") + delta["reasoning_content"]
    for call in delta.get("tool_calls") or ():
        parts = choice.calls.setdefault(call.get("index", 0), _CallParts())
        function = call.get("function") or {}
        parts.id = parts.id or call.get("id")
        parts.name = parts.name or function.get("name")
        parts.arguments += function.get("arguments") or ""


def _finished(choice: _Choice) -> dict:
    calls = [choice.calls[i].as_dict() for i in sorted(choice.calls) if choice.calls[i].complete]
    if calls:
        message = choice.body["message"]
        message["tool_calls"] = calls
        message["content"] = message["content"] or None
    return choice.body


def _merge_logprobs(into: dict | None, new: dict) -> dict:
    if into is None:
        return {k: list(v) for k, v in new.items()}
    for key, values in new.items():
        into.setdefault(key, []).extend(values)
    return into
