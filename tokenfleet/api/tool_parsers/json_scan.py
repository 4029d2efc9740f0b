"""An incremental JSON syntax check, one character at a time: it says where a value ends, which top-level key's
value each character belongs to, and the first character that no JSON text could continue with. A streamed tool
call's arguments go out as they arrive only while they are still the start of valid JSON."""

from __future__ import annotations

import json
import re
from enum import Enum, auto

_WHITESPACE = " \t\n\r"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class _State(Enum):
    VALUE = auto()  # a value must come (after ':' or ',' in an array, or at the start)
    FIRST_IN_ARRAY = auto()  # a value or ']'
    FIRST_KEY = auto()  # a key or '}'
    KEY = auto()  # a key (after ',' in an object)
    COLON = auto()
    AFTER_VALUE = auto()  # ',' or the container's end
    STRING = auto()
    ESCAPE = auto()
    UNICODE = auto()
    NUMBER = auto()
    LITERAL = auto()
    DONE = auto()


class JsonSyntaxError(ValueError):
    """The character cannot continue any JSON text."""


class JsonScanner:
    """Follows one JSON value. `push(ch)` returns the top-level key (of an object value) whose value `ch` is part
    of, or None for anything else (the braces, the keys, whitespace between them); it raises JsonSyntaxError on a
    character that breaks the syntax. `done` once the value is complete (a number ends only at the next character,
    so a top-level number is never done: calls are objects)."""

    def __init__(self) -> None:
        self._stack: list[str] = []  # "{" / "["
        self._state = _State.VALUE
        self._string_is_key = False
        self._text = ""  # the key or number or literal being read
        self._hex_left = 0
        self._key: str | None = None  # the top-level key whose value is being read
        self._in_top_value = False

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    def push(self, ch: str) -> str | None:
        if self._state is _State.DONE:
            raise JsonSyntaxError("the value has ended")
        if self._state is _State.NUMBER and ch not in _NUMBER_CHARS:
            self._end_number()  # the character after a number is read afresh
        role = self._key if self._in_top_value else None
        self._step(ch)
        if role is None and self._in_top_value:
            role = self._key  # the character that started the value belongs to it
        return role

    # --- the automaton ------------------------------------------------------------------------------------------

    def _step(self, ch: str) -> None:
        state = self._state
        if state is _State.STRING:
            self._string_char(ch)
        elif state is _State.ESCAPE:
            self._escape(ch)
        elif state is _State.UNICODE:
            self._unicode(ch)
        elif state is _State.NUMBER:
            self._number_char(ch)
        elif state is _State.LITERAL:
            self._literal_char(ch)
        elif ch in _WHITESPACE:
            return
        elif state in (_State.VALUE, _State.FIRST_IN_ARRAY):
            self._value_start(ch)
        elif state in (_State.FIRST_KEY, _State.KEY):
            self._key_start(ch)
        elif state is _State.COLON:
            self._colon(ch)
        else:
            self._after_value(ch)

    def _value_start(self, ch: str) -> None:
        if ch == "]" and self._state is _State.FIRST_IN_ARRAY:
            self._close()
            return
        if len(self._stack) == 1 and self._stack[0] == "{":
            self._in_top_value = True
        if ch in "{[":
            self._stack.append(ch)
            self._state = _State.FIRST_KEY if ch == "{" else _State.FIRST_IN_ARRAY
        elif ch == '"':
            self._string_is_key, self._state = False, _State.STRING
        elif ch == "-" or ch.isdigit():
            self._text, self._state = ch, _State.NUMBER
        elif ch in _LITERALS:
            self._text, self._state = ch, _State.LITERAL
        else:
            raise JsonSyntaxError(f"a value cannot start with {ch!r}")

    def _key_start(self, ch: str) -> None:
        if ch == "}" and self._state is _State.FIRST_KEY:
            self._close()
        elif ch == '"':
            self._string_is_key, self._text, self._state = True, '"', _State.STRING
        else:
            raise JsonSyntaxError(f"expected a key, got {ch!r}")

    def _colon(self, ch: str) -> None:
        if ch != ":":
            raise JsonSyntaxError(f"expected ':', got {ch!r}")
        self._state = _State.VALUE

    def _after_value(self, ch: str) -> None:
        top = self._stack[-1]
        if ch == ",":
            self._state = _State.KEY if top == "{" else _State.VALUE
        elif ch == ("}" if top == "{" else "]"):
            self._close()
        else:
            raise JsonSyntaxError(f"expected ',' or the end of the {'object' if top == '{' else 'array'}, got {ch!r}")

    def _close(self) -> None:
        self._stack.pop()
        self._value_ended()

    def _value_ended(self) -> None:
        if not self._stack:
            self._state = _State.DONE
            return
        self._state = _State.AFTER_VALUE
        if len(self._stack) == 1 and self._stack[0] == "{" and self._in_top_value:
            self._in_top_value, self._key = False, None

    def _string_char(self, ch: str) -> None:
        if self._string_is_key:
            self._text += ch
        if ch == "\\":
            self._state = _State.ESCAPE
        elif ch == '"':
            self._string_ended()
        elif ord(ch) < 0x20:
            raise JsonSyntaxError("a control character inside a string")

    def _string_ended(self) -> None:
        if not self._string_is_key:
            self._value_ended()
            return
        if len(self._stack) == 1:
            self._key = json.loads(self._text)
        self._state = _State.COLON

    def _escape(self, ch: str) -> None:
        if ch not in _ESCAPES:
            raise JsonSyntaxError(f"an invalid escape \\{ch}")
        if self._string_is_key:
            self._text += ch
        self._hex_left = 4 if ch == "u" else 0
        self._state = _State.UNICODE if ch == "u" else _State.STRING

    def _unicode(self, ch: str) -> None:
        if ch not in _HEX:
            raise JsonSyntaxError(f"an invalid \\u escape digit {ch!r}")
        if self._string_is_key:
            self._text += ch
        self._hex_left -= 1
        if self._hex_left == 0:
            self._state = _State.STRING

    def _number_char(self, ch: str) -> None:
        self._text += ch  # push() ends the number at any other character

    def _end_number(self) -> None:
        if not _NUMBER.fullmatch(self._text):
            raise JsonSyntaxError(f"an invalid number {self._text!r}")
        self._value_ended()
        if self._state is _State.DONE:
            raise JsonSyntaxError("text after the value")

    def _literal_char(self, ch: str) -> None:
        self._text += ch
        literal = _LITERALS[self._text[0]]
        if not literal.startswith(self._text):
            raise JsonSyntaxError(f"expected {literal!r}")
        if self._text == literal:
            self._value_ended()
