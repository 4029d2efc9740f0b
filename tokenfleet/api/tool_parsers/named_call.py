"""One tool call written as its name, a marker, then its arguments' JSON object, as Mistral's v11+ templates have
the model write it: `get_weather[ARGS]{"city": "Paris"}`. Read as it streams, with the same interface as
CallObject: the call starts once the marker (or the arguments' `{`) ends a name that is one of the request's tools,
its arguments go out in pieces while they are still valid JSON, and it is done when the object closes."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from tokenfleet.api.tool_parsers.call_object import CallError
from tokenfleet.api.tool_parsers.json_scan import JsonScanner, JsonSyntaxError
from tokenfleet.api.tool_parsers.pieces import CallArguments, CallStart, Piece

NAME_CHARACTER = re.compile(r"[A-Za-z0-9_.-]")
MAX_NAME = 64  # the API's limit on a function's name
_WHITESPACE = " \t\n\r"


@dataclass
class NamedCall:
    index: int
    tool_names: Collection[str]
    new_id: Callable[[], str]
    marker: str  # between the name and the arguments
    emit: bool = True  # False: read and checked, but nothing sent (a call beyond parallel_tool_calls=false)
    raw: str = ""  # the call's text so far
    started: bool = False
    _name: str = ""
    _marker_read: str = ""
    _arguments: str = ""
    _sent: int = 0  # characters of the arguments already sent
    _scanner: JsonScanner = field(default_factory=JsonScanner)

    @property
    def done(self) -> bool:
        return self._scanner.done

    def feed(self, text: str) -> tuple[int, list[Piece]]:
        """Reads up to the end of the arguments; returns the characters it took and what to send. Raises
        CallError."""
        used, pieces = 0, []
        for ch in text:
            pieces += self._push(ch)
            self.raw += ch
            used += 1
            if self.done:
                break
        if self.started and self._sent < len(self._arguments):
            pieces.append(CallArguments(self.index, self._arguments[self._sent :]))
            self._sent = len(self._arguments)
        return used, pieces if self.emit else []

    def _push(self, ch: str) -> list[Piece]:
        if self.started:
            self._argument_char(ch)
            return []
        if self._marker_read:
            return self._marker_char(ch)
        if NAME_CHARACTER.match(ch):
            self._name += ch
            if len(self._name) > MAX_NAME:
                raise CallError("a tool's name is at most 64 characters")
            return []
        if ch == self.marker[0]:
            return self._marker_char(ch)
        if ch == "{":  # the name then its arguments, without the marker (vLLM reads this too)
            start = self._start()
            self._argument_char(ch)
            return start
        raise CallError(f"{ch!r} cannot follow a tool's name")

    def _marker_char(self, ch: str) -> list[Piece]:
        self._marker_read += ch
        if not self.marker.startswith(self._marker_read):
            raise CallError(f"expected {self.marker!r} after the tool's name")
        return self._start() if self._marker_read == self.marker else []

    def _start(self) -> list[Piece]:
        if self._name not in self.tool_names:
            raise CallError(f"{self._name[:64]!r} is not one of the request's tools")
        self.started = True
        return [CallStart(self.index, self.new_id(), self._name)]

    def _argument_char(self, ch: str) -> None:
        if not self._arguments:
            if ch in _WHITESPACE:
                return
            if ch != "{":
                raise CallError("a call's arguments must be a JSON object")
        try:
            self._scanner.push(ch)
        except JsonSyntaxError as e:
            raise CallError(f"the call's arguments are not valid JSON: {e}") from None
        self._arguments += ch
