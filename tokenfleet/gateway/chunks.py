"""What flows from the router's choice of replica to the relay: a replica's chunk with its usage parsed once, where
the stream enters the gateway, or the news that a replica died and the response goes on from another one."""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.api.usage import Usage


@dataclass
class Chunk:
    data: dict  # the OpenAI chunk as the replica sent it, without its usage
    usage: Usage | None = None

    @classmethod
    def from_wire(cls, data: dict) -> Chunk:
        usage = Usage.parse(data.pop("usage", None))
        return cls(data, usage)

    @property
    def choices(self) -> list[dict]:
        return self.data.get("choices") or []

    @property
    def usage_only(self) -> bool:
        """The closing chunk that carries only the counts (OpenAI's `include_usage`)."""
        return self.usage is not None and not self.choices

    def with_client_usage(self) -> dict:
        """The chunk as a client gets it: OpenAI's usage object, without metering's engine time."""
        if self.usage is None:
            return dict(self.data)
        return {**self.data, "usage": self.usage.for_client()}


@dataclass(frozen=True)
class Retrying:
    attempt: int  # the attempt that starts now (2 for the first retry)
    reason: str  # how the last replica failed: timeout, stream_broken, connect, 5xx

    def as_dict(self) -> dict:
        return {"attempt": self.attempt, "reason": self.reason}


Piece = Chunk | Retrying
