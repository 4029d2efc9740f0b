"""Folds streamed chunks back into the one response object a non-streaming client asked for."""

from __future__ import annotations

from tokenfleet.api.usage import Usage
from tokenfleet.gateway.chunks import Chunk


def aggregate(chunks: list[Chunk], kind: str) -> dict:
    """chat.completion.chunk / text_completion chunks -> chat.completion / text_completion."""
    choices: dict[int, dict] = {}
    usage: Usage | None = None
    head = chunks[0].data if chunks else {}
    for chunk in chunks:
        usage = chunk.usage or usage
        for part in chunk.choices:
            _merge(choices.setdefault(part["index"], _empty(part["index"], kind)), part, kind)
    return {
        "id": head.get("id"),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": head.get("created"),
        "model": head.get("model"),
        "choices": [choices[i] for i in sorted(choices)],
        "usage": usage.for_client() if usage is not None else None,
    }


def _empty(index: int, kind: str) -> dict:
    choice = {"index": index, "logprobs": None, "finish_reason": None}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": ""}
    else:
        choice["text"] = ""
    return choice


def _merge(choice: dict, part: dict, kind: str) -> None:
    if kind == "chat":
        choice["message"]["content"] += (part.get("delta") or {}).get("content") or ""
    else:
        choice["text"] += part.get("text") or ""
    if part.get("finish_reason"):
        choice["finish_reason"] = part["finish_reason"]
    if part.get("logprobs"):
        choice["logprobs"] = _merge_logprobs(choice["logprobs"], part["logprobs"])


def _merge_logprobs(into: dict | None, new: dict) -> dict:
    if into is None:
        return {k: list(v) for k, v in new.items()}
    for key, values in new.items():
        into.setdefault(key, []).extend(values)
    return into
