"""`conversations:` in fleet.yaml."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ConversationSettings:
    max_message_chars: int = 32_000  # a longer message or system prompt is refused with a 413
    max_tokens: int = 1024  # a reply's max_tokens when the client gives none (at most a quarter of the window)
    save_interval_s: float = 1.0  # a streaming reply is saved this often, so a refresh shows the text so far
    stale_after_s: float = 30.0  # a reply still 'streaming' with no save for this long lost its gateway: failed
    default_model: str | None = None  # for conversations created without one; else the first served model
    max_page: int = 100  # the largest `limit` of a listing

    def __post_init__(self) -> None:
        if self.max_message_chars < 1 or self.max_tokens < 1 or self.max_page < 1:
            raise ValueError("max_message_chars, max_tokens and max_page must be at least 1")
        if not self.save_interval_s > 0:
            raise ValueError(f"save_interval_s must be positive, got {self.save_interval_s}")
        if not self.stale_after_s >= 3 * self.save_interval_s:
            raise ValueError(
                f"stale_after_s ({self.stale_after_s}) must be at least three save intervals "
                f"({3 * self.save_interval_s}), or live replies would be taken for dead ones"
            )
