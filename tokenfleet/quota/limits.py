"""What a tenant may use: the four quota dimensions, per user and per organisation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

MAX_LIMIT = 10**12  # anything larger is a typo, not a limit


@dataclass(frozen=True)
class Limits:
    """None means unlimited on that dimension."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None
    tokens_per_day: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{f.name} must be a whole number or null (unlimited), got {value!r}")
            if not 0 <= value <= MAX_LIMIT:
                raise ValueError(f"{f.name} must be between 0 and {MAX_LIMIT}, got {value}")

    def override(self, other: Limits | None) -> Limits:
        """These limits with every dimension `other` sets replaced (tier defaults ← per-tenant overrides)."""
        if other is None:
            return self
        return replace(
            self, **{f.name: getattr(other, f.name) for f in fields(other) if getattr(other, f.name) is not None}
        )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None, where: str) -> Limits:
        raw = raw or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{where}: unknown limit(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        try:
            return cls(**raw)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
