"""What a tool-call parser makes of a model's text, piece by piece as the text streams: plain text (the message's
content), then for each call its start (id and name, once), its arguments in pieces, and its end once it parsed."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass

_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next piece of the arguments' JSON text


@dataclass(frozen=True)
class CallDone:
    """The call parsed in full: its arguments are a JSON object. A call that starts but never gets here (the output
    ended half way, or the JSON broke) has its text sent again as content."""

    index: int


Piece = Text | CallStart | CallArguments | CallDone


@dataclass(frozen=True)
class ToolCall:
    """A finished call as the API returns it: `arguments` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


def openai_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


def short_call_id() -> str:
    """Mistral's templates take only ids of 9 letters and digits."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
