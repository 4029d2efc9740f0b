"""Mistral's calls, in its two forms. Up to tokenizer v7 (7B v0.3, Nemo, Ministral): the special token
`[TOOL_CALLS]`, then a JSON array of calls:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

From tokenizer v11 (Mistral-Small-3.2, Magistral, Devstral): each call is `[TOOL_CALLS]`, the function's name, the
special token `[ARGS]` and the arguments' JSON object, calls one after the other:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}

Their templates take only call ids of exactly 9 letters and digits, in the history too (v11's write none).
"""

from __future__ import annotations

import re

from tokenfleet.api.tool_parsers.format import ToolFormat
from tokenfleet.api.tool_parsers.framing import Framing
from tokenfleet.api.tool_parsers.grammar import NO_PARAMETERS, CallsGrammar, call_schema, lark_json, lark_literal
from tokenfleet.api.tool_parsers.pieces import short_call_id
from tokenfleet.model.tokenizer import Tokenizer

TRIGGER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
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


def grammar_v11(calls: CallsGrammar, tokenizer: Tokenizer) -> str:
    """A call is the trigger, then one of the functions: its name, [ARGS] and its own parameters' schema."""
    trigger, marker = lark_literal(TRIGGER, tokenizer), lark_literal(ARGS, tokenizer)
    functions = calls.functions
    rules = "".join(
        f"function_{i}: {lark_literal(f.name)} {marker} arguments_{i}\n"
        f"arguments_{i}: {lark_json(f.parameters or NO_PARAMETERS)}\n"
        for i, f in enumerate(functions)
    )
    alternatives = " | ".join(f"function_{i}" for i in range(len(functions)))
    return (
        calls.start("call+" if calls.parallel else "call")
        + f"call: {trigger} ({alternatives})\n"
        + rules
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


MISTRAL_V11 = ToolFormat(
    "mistral_v11",
    Framing(trigger=TRIGGER, arguments_marker=ARGS),
    detect=lambda template: TRIGGER in template and ARGS in template,
    grammar=grammar_v11,
    new_id=short_call_id,
    history_id=history_id,
)
