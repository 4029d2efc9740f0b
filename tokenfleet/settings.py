"""Reading one settings section of a YAML file into its dataclass; every component owns its section's dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Settings = TypeVar("_Settings", bound="DataclassInstance")


def section(cls: type[_Settings], raw: Mapping[str, Any] | None, where: str) -> _Settings:
    """A settings dataclass from its YAML mapping; unknown keys and bad values are start-up errors naming `where`."""
    raw = dict(raw or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    try:
        return cls(**raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
