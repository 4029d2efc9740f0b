"""Opaque page cursors: the sort key of the last row a page showed, so the next page starts right after it (no
gaps or repeats however many rows are added meanwhile)."""

from __future__ import annotations

import base64
import binascii
import json


class BadCursor(ValueError):
    pass


def encode(kind: str, *key: object) -> str:
    raw = json.dumps([kind, *key], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(cursor: str, kind: str, *types: type) -> list:
    """The key of a cursor made by `encode(kind, ...)`; BadCursor for anything else, e.g. another listing's."""
    try:
        raw = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError, RecursionError):  # a forged cursor can nest deep
        raise BadCursor(f"cursor {cursor[:40]!r} is not one this listing gave out") from None
    if (
        not isinstance(raw, list)
        or len(raw) != len(types) + 1
        or raw[0] != kind
        or not all(isinstance(v, t) and not isinstance(v, bool) for v, t in zip(raw[1:], types))
    ):
        raise BadCursor(f"cursor {cursor[:40]!r} is not one this listing gave out")
    return raw[1:]
