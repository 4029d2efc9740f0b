"""The streaming parser every tool-call format shares: content, then a region of calls that a trigger opens
(`<tool_call>`, `[TOOL_CALLS]`, or a `{` that starts the output), each call a JSON object (see call_object.py) or
a name, a marker and the arguments' object (Mistral v11's `name[ARGS]{...}`, named_call.py), with the format's
literals around and between them. A format is a Framing.

Text goes out as soon as it cannot be the start of a trigger. A region that turns out not to be calls (the output
ended half way through one, the JSON broke, an unknown tool name) is sent again as content, from where the last
complete call ended, and everything after it is content too: a model's mistake never fails the response.
Non-streamed and streamed responses are made by the same parser, so their content and their complete calls are the
same; a stream may also have sent the start of a call that then broke.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import Enum, auto

from tokenfleet.api.tool_parsers.call_object import CallError, CallObject
from tokenfleet.api.tool_parsers.named_call import NAME_CHARACTER, NamedCall
from tokenfleet.api.tool_parsers.pieces import CallDone, Piece, Text

_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class Framing:
    trigger: str | None  # opens the region of calls; None: the output is calls when its first character is `{`
    open: str = ""  # after the trigger, before the first call (Mistral's "[")
    call_suffix: str = ""  # after each call (Hermes' "</tool_call>")
    separator: str = ""  # between calls; "" when each call comes with its own trigger
    close: str = ""  # after the last call (Mistral's "]")
    arguments_marker: str = ""  # a call is its name, this, then its arguments (Mistral v11's "[ARGS]"); "": JSON


class _State(Enum):
    START = auto()  # (trigger None) whitespace so far: calls or content is not decided yet
    CONTENT = auto()
    PLAIN = auto()  # content to the end: the calls' region broke, or the output did not start as calls
    LITERAL = auto()  # a literal of the framing must come (whitespace before it allowed)
    BEFORE_CALL = auto()  # `{` must come
    CALL = auto()
    AFTER_CALL = auto()  # the separator, the close, or (without a separator) anything


class _Broken(Exception):
    """The region is not calls: `consumed` characters of the text given to the step were still part of it."""

    def __init__(self, consumed: int) -> None:
        self.consumed = consumed


class FramedParser:
    """One choice's parser: `feed(text)` and, once the output ends, `finish()`, each returning the pieces to send."""

    def __init__(
        self,
        framing: Framing,
        tool_names: Collection[str],
        new_id: Callable[[], str],
        max_calls: int | None = None,
    ) -> None:
        self.framing, self.tool_names, self.new_id, self.max_calls = framing, tool_names, new_id, max_calls
        self._state = _State.START if framing.trigger is None else _State.CONTENT
        self._held = ""  # text not yet sent: maybe the start of a trigger, or a literal being matched
        self._literal, self._after_literal = "", _State.BEFORE_CALL
        self._region = ""  # the region's text since the last complete call: content again if it breaks
        self._call: CallObject | NamedCall | None = None
        self._started = 0  # calls started (their index)
        self._complete = 0
        self._after_calls = False  # whitespace after the last call is not content

    # --- the API ------------------------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Piece]:
        pieces: list[Piece] = []
        while text:
            try:
                used = self._step(text, pieces)
            except _Broken as broken:
                used = broken.consumed + self._break_region(text[broken.consumed :], pieces)
            text = text[used:]
        return _merged(pieces)

    def finish(self) -> list[Piece]:
        pieces: list[Piece] = []
        state = self._state
        if state in (_State.CONTENT, _State.START):
            if self._held and not (self._after_calls and not self._held.strip(_WHITESPACE)):
                pieces.append(Text(self._held))
        elif state is _State.LITERAL and self._after_literal is _State.AFTER_CALL:
            self._complete_call(pieces)  # e.g. Hermes without its last `</tool_call>`: the call itself is whole
        elif state in (_State.LITERAL, _State.BEFORE_CALL, _State.CALL):
            self._break_region("", pieces)
        self._held = ""
        return _merged(pieces)

    # --- the states ---------------------------------------------------------------------------------------------

    def _step(self, text: str, pieces: list[Piece]) -> int:
        state = self._state
        if state is _State.PLAIN:
            pieces.append(Text(text))
            return len(text)
        if state is _State.START:
            return self._start(text, pieces)
        if state is _State.CONTENT:
            return self._content(text, pieces)
        if state is _State.CALL:
            return self._in_call(text, pieces)
        ch = text[0]
        self._region += ch
        try:
            if state is _State.LITERAL:
                self._literal_char(ch, pieces)
            elif state is _State.BEFORE_CALL:
                self._before_call(ch)
            else:
                self._after_call(ch, pieces)
        except CallError:
            self._region = self._region[:-1]
            raise _Broken(0) from None
        return 1

    def _start(self, text: str, pieces: list[Piece]) -> int:
        stripped = text.lstrip(_WHITESPACE)
        if not stripped:
            self._held += text
            return len(text)
        skipped = len(text) - len(stripped)
        if stripped[0] == "{":
            self._region, self._held = self._held + text[:skipped], ""
            self._state = _State.BEFORE_CALL
        else:
            self._state = _State.PLAIN
            pieces.append(Text(self._held + text[:skipped]))
            self._held = ""
        return skipped

    def _content(self, text: str, pieces: list[Piece]) -> int:
        trigger = self.framing.trigger
        assert trigger is not None
        buffer = self._held + text
        at = buffer.find(trigger)
        if at < 0:
            keep = _partial_suffix(buffer, trigger)
            sendable, self._held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
            self._send_content(sendable, pieces)
            return len(text)
        self._send_content(buffer[:at], pieces)
        self._held, self._region = "", trigger
        self._expect(self.framing.open, _State.BEFORE_CALL)
        return len(text) - (len(buffer) - at - len(trigger))

    def _send_content(self, text: str, pieces: list[Piece]) -> None:
        """Whitespace right after calls waits: it is content only if more text follows."""
        if not text:
            return
        if self._after_calls and not text.strip(_WHITESPACE):
            self._held = text + self._held
            return
        self._after_calls = False
        pieces.append(Text(text))

    def _expect(self, literal: str, then: _State) -> None:
        if literal:
            self._state, self._literal, self._after_literal = _State.LITERAL, literal, then
        else:
            self._state = then

    def _literal_char(self, ch: str, pieces: list[Piece]) -> None:
        if not self._held and ch in _WHITESPACE:
            return
        self._held += ch
        if not self._literal.startswith(self._held):
            raise CallError(f"expected {self._literal!r}")
        if self._held == self._literal:
            self._held = ""
            if self._after_literal is _State.AFTER_CALL:
                self._complete_call(pieces)
            else:
                self._state = self._after_literal
            if self._after_literal is _State.CONTENT:
                self._region, self._after_calls = "", True

    def _before_call(self, ch: str) -> None:
        if ch in _WHITESPACE:
            return
        emit = self.max_calls is None or self._started < self.max_calls
        marker = self.framing.arguments_marker
        if marker:
            if not NAME_CHARACTER.match(ch):
                raise CallError("a call starts with the tool's name")
            self._call = NamedCall(self._started, self.tool_names, self.new_id, marker, emit)
        elif ch == "{":
            self._call = CallObject(self._started, self.tool_names, self.new_id, emit)
        else:
            raise CallError("a call is a JSON object")
        self._call.feed(ch)
        self._state = _State.CALL

    def _in_call(self, text: str, pieces: list[Piece]) -> int:
        call = self._call
        assert call is not None
        was_started, before = call.started, len(call.raw)
        try:
            used, new = call.feed(text)
        except CallError:
            consumed = len(call.raw) - before
            self._region += text[:consumed]
            raise _Broken(consumed) from None
        self._region += text[:used]
        pieces += new
        if call.started and not was_started and call.emit:
            self._started += 1
        if call.done:
            self._expect(self.framing.call_suffix, _State.AFTER_CALL)
            if self._state is _State.AFTER_CALL:
                self._complete_call(pieces)
        return used

    def _complete_call(self, pieces: list[Piece]) -> None:
        call = self._call
        if call is not None and call.emit:
            pieces.append(CallDone(call.index))
            self._complete += 1
        self._call, self._region = None, ""
        if self.framing.separator:
            self._state = _State.AFTER_CALL
        else:
            self._state, self._after_calls = _State.CONTENT, True

    def _after_call(self, ch: str, pieces: list[Piece]) -> None:
        framing = self.framing
        if ch in _WHITESPACE:
            return
        if ch == framing.separator:
            self._state = _State.BEFORE_CALL
        elif framing.close and ch == framing.close[0]:
            self._state, self._held = _State.LITERAL, ""
            self._literal, self._after_literal = framing.close, _State.CONTENT
            self._literal_char(ch, pieces)
        elif not framing.close:
            self._state = _State.PLAIN  # text after the last call (Llama's): content
            pieces.append(Text(self._region.lstrip(_WHITESPACE)))
            self._region = ""
        else:
            raise CallError(f"expected {framing.separator!r} or {framing.close!r}")

    def _break_region(self, text: str, pieces: list[Piece]) -> int:
        """The region is not calls after all: its text since the last complete call, and all that follows, is
        content (a call beyond the limit of parallel_tool_calls=false is dropped instead)."""
        dropped = self._call is not None and not self._call.emit
        if not dropped:
            pieces.append(Text(self._region + text))
        self._call, self._region, self._held = None, "", ""
        self._state = _State.PLAIN
        return len(text)


def _partial_suffix(text: str, trigger: str) -> int:
    """The length of the longest end of `text` that is a proper start of `trigger`."""
    for size in range(min(len(trigger) - 1, len(text)), 0, -1):
        if text.endswith(trigger[:size]):
            return size
    return 0


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent texts as one, empty ones dropped."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, Text):
            if not piece.text:
                continue
            if out and isinstance(out[-1], Text):
                out[-1] = Text(out[-1].text + piece.text)
                continue
        out.append(piece)
    return out
