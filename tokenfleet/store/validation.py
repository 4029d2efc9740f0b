"""Checks on what callers give the tenant store; each failure is a ValueError that says what was wrong."""

from __future__ import annotations

import math
import re
from collections.abc import Collection

from tokenfleet.quota.limits import Limits
from tokenfleet.store.models import NAME_LENGTH

_SLUG_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


def check_name(value: object, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    value = value.strip()
    if len(value) > NAME_LENGTH:
        raise ValueError(f"{what} is longer than {NAME_LENGTH} characters")
    if any(ch < " " for ch in value):
        raise ValueError(f"{what} must not contain control characters")
    return value


def check_slug(value: object) -> str:
    if not isinstance(value, str) or not _SLUG_RE.fullmatch(value):
        raise ValueError(
            f"organisation id must be 1-64 characters of a-z, 0-9, '-' and '_' (starting with a "
            f"letter or digit), got {value!r}"
        )
    return value


def check_tier(value: object, tiers: Collection[str] | None) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"tier must be a non-empty string, got {value!r}")
    if tiers is not None and value not in tiers:
        raise ValueError(f"unknown tier {value!r}; known: {', '.join(sorted(tiers))}")
    return value


def check_share(value: object) -> float | None:
    """provisioned_share: the fraction (0–1) of provisioned throughput reserved for an organisation, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not 0 <= value <= 1:
        raise ValueError(f"provisioned_share must be a number from 0 to 1 or null, got {value!r}")
    return float(value)


def check_limits(value: object, what: str = "limits") -> Limits:
    if value is None:
        return Limits()
    if isinstance(value, Limits):
        return value
    if isinstance(value, dict):
        return Limits.from_dict(value, what)
    raise ValueError(f"{what} must be Limits or a mapping of limit names to numbers, got {value!r}")
