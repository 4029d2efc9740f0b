"""Reasoning for chat templates that think (Qwen3's, DeepSeek-R1's): the text between `<think>` and `</think>` at
the start of the output is the message's `reasoning_content`, the rest its content. Templates that open the think
block in the prompt itself (an R1-style generation prompt, or a prefill) start the output inside it; templates
that close it there (Qwen3's `enable_thinking: false`) start it outside. The tokens of the thinking, its tags
included, are counted as usage's reasoning_tokens."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

OPEN, CLOSE = "<think>", "</think>"
_WHITESPACE = " \t\n\r"
# what the grammar of a forced tool call allows before the calls: the thinking, then any line breaks
_THOUGHT_RULES = 'thought[suffix="</think>"]: /(?s:.*)/\nthink: "<think>" thought\nGAP: /[ \\n]+/\n'


def template_thinks(template: str | None) -> bool:
    return bool(template) and (OPEN in template or CLOSE in template)  # type: ignore[operator]


class Start(Enum):
    """Where the output starts, as the prompt leaves it."""

    MAY_THINK = auto()  # it may open a think block
    THINKING = auto()  # inside one the prompt opened
    ANSWERING = auto()  # after one the prompt closed: no thinking this turn


def start_from_prompt(prompt_tail: str) -> Start:
    """From the end of the rendered prompt (its last few tokens' text)."""
    opened, closed = prompt_tail.rfind(OPEN), prompt_tail.rfind(CLOSE)
    if opened > closed:
        return Start.THINKING
    return Start.ANSWERING if closed >= 0 else Start.MAY_THINK


def grammar_prefix(start: Start) -> tuple[str, str]:
    """(Lark expression, its rules) for the thinking a forced tool call may come after."""
    if start is Start.THINKING:
        return "thought GAP?", _THOUGHT_RULES
    if start is Start.MAY_THINK:
        return "(think GAP?)?", _THOUGHT_RULES
    return "", ""


class _State(Enum):
    UNDECIDED = auto()  # only whitespace, or the start of "<think>", so far
    REASONING = auto()
    AFTER = auto()  # right after `</think>`: whitespace is dropped
    CONTENT = auto()


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """One choice's output split into reasoning and content as it streams; counts the reasoning's tokens."""

    def __init__(self, start: Start) -> None:
        self._state = {
            Start.THINKING: _State.REASONING,
            Start.MAY_THINK: _State.UNDECIDED,
            Start.ANSWERING: _State.CONTENT,
        }[start]
        self._held = ""
        self._undecided_tokens = 0
        self.reasoning_tokens = 0

    def feed(self, text: str, num_tokens: int = 0) -> Split:
        was = self._state
        split = Split()
        self._consume(text, split)
        if was is _State.REASONING or self._state is _State.REASONING or split.reasoning:
            self.reasoning_tokens += num_tokens + self._undecided_tokens
            self._undecided_tokens = 0
        elif self._state is _State.UNDECIDED:
            self._undecided_tokens += num_tokens
        else:
            self._undecided_tokens = 0
        return split

    def finish(self) -> Split:
        """The output ended: what was held back goes where it was going."""
        split = Split()
        if self._state is _State.REASONING:
            split.reasoning = self._held
        elif self._state is not _State.AFTER:
            split.content = self._held
        self._held = ""
        return split

    def _consume(self, text: str, split: Split) -> None:
        while text:
            state = self._state
            if state is _State.CONTENT:
                split.content += text
                return
            if state is _State.UNDECIDED:
                text = self._undecided(text)
            elif state is _State.REASONING:
                text = self._reasoning(text, split)
            else:
                text = self._after(text)

    def _undecided(self, text: str) -> str:
        buffer = self._held + text
        stripped = buffer.lstrip(_WHITESPACE)
        if stripped.startswith(OPEN):
            self._held, self._state = "", _State.REASONING
            return stripped[len(OPEN) :]
        if OPEN.startswith(stripped):
            self._held = buffer
            return ""
        self._held, self._state = "", _State.CONTENT
        return buffer

    def _reasoning(self, text: str, split: Split) -> str:
        buffer = self._held + text
        at = buffer.find(CLOSE)
        if at >= 0:
            split.reasoning += buffer[:at]
            self._held, self._state = "", _State.AFTER
            return buffer[at + len(CLOSE) :]
        keep = _partial_suffix(buffer, CLOSE)
        split.reasoning += buffer[: len(buffer) - keep]
        self._held = buffer[len(buffer) - keep :]
        return ""

    def _after(self, text: str) -> str:
        stripped = text.lstrip(_WHITESPACE)
        if stripped:
            self._state = _State.CONTENT
        return stripped


def _partial_suffix(text: str, tag: str) -> int:
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
