"""A response's token counts: what a replica reports on its chunks (OpenAI's `usage` object, plus the engine time
that only metering reads) and what the gateway parses once, where a replica's stream enters it."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    engine_s: float = 0.0  # the replica's busy time spent on it; the gateway meters it and keeps it from clients
    reasoning_tokens: int = 0  # of completion_tokens, those of the model's thinking

    @property
    def total_tokens(self) -> int:
        """What a request counts against its quota: its prompt and what it generated."""
        return self.prompt_tokens + self.completion_tokens

    def for_client(self) -> dict:
        """OpenAI's usage object (with completion_tokens_details where the model thought, as vLLM sends it)."""
        usage: dict = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.reasoning_tokens:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage

    def as_dict(self) -> dict:
        """On the wire from a replica to the gateway: OpenAI's object and the engine time."""
        return {**self.for_client(), "engine_s": round(self.engine_s, 6)}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), separators=(",", ":"))

    @classmethod
    def parse(cls, value: object) -> Usage | None:
        """A usage object from any OpenAI-compatible server (ours, vLLM, SGLang, OpenAI): missing or null counts
        are 0; anything that is not an object is no usage at all."""
        if not isinstance(value, dict) or not value:
            return None
        details = value.get("prompt_tokens_details")
        completion_details = value.get("completion_tokens_details")
        return cls(
            _count(value.get("prompt_tokens")),
            _count(value.get("completion_tokens")),
            _count(details.get("cached_tokens")) if isinstance(details, dict) else 0,
            _seconds(value.get("engine_s")),
            _count(completion_details.get("reasoning_tokens")) if isinstance(completion_details, dict) else 0,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Usage | None:
        return cls.parse(json.loads(text))


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _seconds(value: object) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else 0.0
