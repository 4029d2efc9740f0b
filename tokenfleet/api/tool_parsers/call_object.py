"""One tool call written as a JSON object, `{"name": ..., "arguments": {...}}` (Llama says "parameters"), read as it
streams: the call starts once its name is known (and is one of the request's tools), its arguments go out in
pieces while they are still valid JSON, and it is done when the object closes and parses."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from tokenfleet.api.tool_parsers.json_scan import JsonScanner, JsonSyntaxError
from tokenfleet.api.tool_parsers.pieces import CallArguments, CallStart, Piece

ARGUMENT_KEYS = ("arguments", "parameters")


class CallError(ValueError):
    """The text is not a call to one of the tools."""


@dataclass
class CallObject:
    index: int
    tool_names: Collection[str]
    new_id: Callable[[], str]
    emit: bool = True  # False: read and checked, but nothing sent (a call beyond parallel_tool_calls=false)
    raw: str = ""  # the object's text so far
    started: bool = False
    _scanner: JsonScanner = field(default_factory=JsonScanner)
    _name_raw: str = ""
    _arguments_key: str | None = None
    _arguments: str = ""  # the arguments' text so far
    _sent: int = 0  # characters of it already sent

    @property
    def done(self) -> bool:
        return self._scanner.done

    def feed(self, text: str) -> tuple[int, list[Piece]]:
        """Reads up to the end of the object; returns the characters it took and what to send. Raises CallError."""
        used = 0
        for ch in text:
            self._push(ch)
            used += 1
            if self.done:
                break
        pieces = self._pieces()
        if self.done:
            pieces += self._finish()
        return used, pieces if self.emit else []

    def _push(self, ch: str) -> None:
        try:
            role = self._scanner.push(ch)
        except JsonSyntaxError as e:
            raise CallError(f"the call is not valid JSON: {e}") from None
        self.raw += ch
        if role == "name":
            self._name_raw += ch
        elif role in ARGUMENT_KEYS and self._arguments_key in (None, role):
            if not self._arguments and ch != "{":
                raise CallError("a call's arguments must be a JSON object")
            self._arguments_key = role
            self._arguments += ch

    def _pieces(self) -> list[Piece]:
        pieces: list[Piece] = []
        if not self.started and self._name_complete():
            pieces.append(self._start())
        if self.started and self._sent < len(self._arguments):
            pieces.append(CallArguments(self.index, self._arguments[self._sent :]))
            self._sent = len(self._arguments)
        return pieces

    def _name_complete(self) -> bool:
        return len(self._name_raw) >= 2 and self._name_raw.endswith('"') and not self._scanner_in_name()

    def _scanner_in_name(self) -> bool:
        try:
            json.loads(self._name_raw)
        except json.JSONDecodeError:
            return True  # e.g. `"a\"` : the closing quote was escaped
        return False

    def _start(self) -> Piece:
        name = json.loads(self._name_raw)
        if not isinstance(name, str) or name not in self.tool_names:
            raise CallError(f"{str(name)[:64]!r} is not one of the request's tools")
        self.started = True
        return CallStart(self.index, self.new_id(), name)

    def _finish(self) -> list[Piece]:
        """The object closed: it must have had a name; no arguments at all means an empty object."""
        if not self.started:
            raise CallError("the call has no name")
        try:
            arguments = json.loads(self._arguments or "{}")
        except json.JSONDecodeError as e:
            raise CallError(f"the call's arguments are not valid JSON: {e}") from None
        if not isinstance(arguments, dict):
            raise CallError("a call's arguments must be a JSON object")
        if not self._arguments:
            self._arguments, self._sent = "{}", 2
            return [CallArguments(self.index, "{}")]
        return []
