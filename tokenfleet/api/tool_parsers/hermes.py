"""Hermes-style calls, as Qwen2.5 and Qwen3 write them: each call a JSON object between `<tool_call>` and
`</tool_call>` on lines of their own, after any content:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from tokenfleet.api.tool_parsers.format import ToolFormat
from tokenfleet.api.tool_parsers.framing import Framing
from tokenfleet.api.tool_parsers.grammar import CallsGrammar, call_schema, lark_json, lark_literal
from tokenfleet.model.tokenizer import Tokenizer

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def grammar(calls: CallsGrammar, tokenizer: Tokenizer) -> str:
    return (
        calls.start('call ("\\n" call)*' if calls.parallel else "call")
        + f'call: {lark_literal(OPEN, tokenizer)} "\\n" call_json "\\n" {lark_literal(CLOSE, tokenizer)}\n'
        + f"call_json: {lark_json(call_schema(calls.functions, 'arguments'))}\n"
        + calls.prefix_rules
    )


HERMES = ToolFormat(
    "hermes",
    Framing(trigger=OPEN, call_suffix=CLOSE),
    detect=lambda template: OPEN in template,
    grammar=grammar,
)
