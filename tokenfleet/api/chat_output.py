"""One chat choice's output as the API returns it: the text split into reasoning and content (reasoning.py), the
content's tool calls parsed out (tool_parsers/), as deltas while it streams and as the whole message at the end.
Both come from the same parser fed the same way, so a stream assembled is the non-streamed message."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenfleet.api.reasoning import ReasoningSplitter
from tokenfleet.api.tool_parsers.framing import FramedParser
from tokenfleet.api.tool_parsers.pieces import CallArguments, CallDone, CallStart, Piece, Text, ToolCall


@dataclass
class ToolCallDelta:
    index: int
    arguments: str
    id: str | None = None  # the first delta of a call carries its id and name
    name: str | None = None

    def as_dict(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        else:
            out["function"] = {"arguments": self.arguments}
        return out


@dataclass
class MessageDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, more: MessageDelta) -> None:
        self.content += more.content
        self.reasoning += more.reasoning
        for call in more.tool_calls:
            if call.id is None and self.tool_calls and self.tool_calls[-1].index == call.index:
                self.tool_calls[-1].arguments += call.arguments
            else:
                self.tool_calls.append(call)


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""
    done: bool = False


class ChatOutput:
    """Feed it each new piece of text (`feed`) and, at the end, `finish()`; `tool_calls` are the calls that parsed
    in full."""

    def __init__(self, reasoning: ReasoningSplitter | None = None, tools: FramedParser | None = None) -> None:
        self.reasoning, self.tools = reasoning, tools
        self._content: list[str] = []  # joined once, for the whole message
        self._reasoning: list[str] = []
        self._calls: dict[int, _Call] = {}

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self._reasoning)

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning.reasoning_tokens if self.reasoning is not None else 0

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(c.id, c.name, c.arguments) for c in self._calls.values() if c.done]

    def feed(self, text: str, num_tokens: int = 0) -> MessageDelta:
        if self.reasoning is None:
            return self._content_delta(text)
        split = self.reasoning.feed(text, num_tokens)
        delta = self._content_delta(split.content)
        delta.reasoning = split.reasoning
        self._reasoning.append(split.reasoning)
        return delta

    def finish(self) -> MessageDelta:
        delta = MessageDelta()
        if self.reasoning is not None:
            split = self.reasoning.finish()
            delta = self._content_delta(split.content)
            delta.reasoning = split.reasoning
            self._reasoning.append(split.reasoning)
        if self.tools is not None:
            self._apply(self.tools.finish(), delta)
        return delta

    def _content_delta(self, text: str) -> MessageDelta:
        delta = MessageDelta()
        if self.tools is None:
            delta.content = text
            self._content.append(text)
        elif text:
            self._apply(self.tools.feed(text), delta)
        return delta

    def _apply(self, pieces: list[Piece], delta: MessageDelta) -> None:
        for piece in pieces:
            if isinstance(piece, Text):
                delta.content += piece.text
                self._content.append(piece.text)
            elif isinstance(piece, CallStart):
                self._calls[piece.index] = _Call(piece.id, piece.name)
                delta.tool_calls.append(ToolCallDelta(piece.index, "", piece.id, piece.name))
            elif isinstance(piece, CallArguments):
                self._calls[piece.index].arguments += piece.text
                _add_arguments(delta.tool_calls, piece)
            elif isinstance(piece, CallDone):
                self._calls[piece.index].done = True


def _add_arguments(deltas: list[ToolCallDelta], piece: CallArguments) -> None:
    """Arguments join the delta of their call already in this chunk, if any (one delta per call per chunk)."""
    if deltas and deltas[-1].index == piece.index:
        deltas[-1].arguments += piece.text
    else:
        deltas.append(ToolCallDelta(piece.index, piece.text))
