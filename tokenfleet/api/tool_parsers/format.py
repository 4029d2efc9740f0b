"""A tool-call format: how a family of chat templates has the model write its calls (the Framing its parser reads),
the grammar that makes it write them, and what its templates need of the calls in the history."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from tokenfleet.api.tool_parsers.framing import FramedParser, Framing
from tokenfleet.api.tool_parsers.grammar import CallsGrammar
from tokenfleet.api.tool_parsers.pieces import openai_call_id
from tokenfleet.model.tokenizer import Tokenizer


def _same(call_id: str) -> str:
    return call_id


@dataclass(frozen=True)
class ToolFormat:
    name: str
    framing: Framing
    detect: Callable[[str], bool]  # whether a chat template (its source) writes this format
    grammar: Callable[[CallsGrammar, Tokenizer], str]  # the Lark grammar of the calls
    new_id: Callable[[], str] = openai_call_id
    history_id: Callable[[str], str] = _same  # a call id as the template takes it back in the history

    def parser(self, tool_names: Collection[str], max_calls: int | None = None) -> FramedParser:
        return FramedParser(self.framing, tool_names, self.new_id, max_calls)

    def keeps_special_tokens(self, tokenizer: Tokenizer) -> bool:
        """Whether the detokenizer must keep special tokens: the calls' trigger or marker is one (Mistral's
        `[TOOL_CALLS]`, `[ARGS]`), and without it the text would not say where calls are."""
        literals = (self.framing.trigger, self.framing.arguments_marker)
        token_ids = {tokenizer.token_to_id(literal) for literal in literals if literal}
        return bool(token_ids & tokenizer.all_special_ids)
