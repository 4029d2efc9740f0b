"""Mistral's calls (7B v0.3, Nemo, Ministral): the special token `[TOOL_CALLS]`, then a JSON array of calls:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

Its templates take only call ids of exactly 9 letters and digits, in the history too.
"""

from __future__ import annotations

import re

from tokenfleet.api.tool_parsers.format import ToolFormat
from tokenfleet.api.tool_parsers.framing import Framing
from tokenfleet.api.tool_parsers.grammar import CallsGrammar, call_schema, lark_json, lark_literal
from tokenfleet.api.tool_parsers.pieces import short_call_id
from tokenfleet.model.tokenizer import Tokenizer

TRIGGER = "[TOOL_CALLS]"
ID_LENGTH = 9


def grammar(calls: CallsGrammar, tokenizer: Tokenizer) -> str:
    call = call_schema(calls.functions, "arguments")
    definitions = call.pop("$defs")
    array = {"type": "array", "items": call, "minItems": 1, "$defs": definitions}
    if not calls.parallel:
        array["maxItems"] = 1
    return (
        calls.start(f'{lark_literal(TRIGGER, tokenizer)} " "? calls_json')
        + f"calls_json: {lark_json(array)}\n"
        + calls.prefix_rules
    )


def history_id(call_id: str) -> str:
    """Any client's id (OpenAI's `call_...`) as the 9 characters Mistral's templates accept."""
    return re.sub(r"[^A-Za-z0-9]", "", call_id)[-ID_LENGTH:].rjust(ID_LENGTH, "0")


MISTRAL = ToolFormat(
    "mistral",
    Framing(trigger=TRIGGER, open="[", separator=",", close="]"),
    detect=lambda template: TRIGGER in template,
    grammar=grammar,
    new_id=short_call_id,
    history_id=history_id,
)
