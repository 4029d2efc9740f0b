"""Llama 3.1-3.3's JSON calls: when the model calls, its whole output is the call (after the special
`<|python_tag|>` token, which the detokenizer drops), more than one separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}
"""

from __future__ import annotations

from tokenfleet.api.tool_parsers.format import ToolFormat
from tokenfleet.api.tool_parsers.framing import Framing
from tokenfleet.api.tool_parsers.grammar import CallsGrammar, call_schema, lark_json
from tokenfleet.model.tokenizer import Tokenizer


def grammar(calls: CallsGrammar, tokenizer: Tokenizer) -> str:
    return (
        calls.start('call_json ("; " call_json)*' if calls.parallel else "call_json")
        + f"call_json: {lark_json(call_schema(calls.functions, 'parameters'))}\n"
        + calls.prefix_rules
    )


def _writes_llama_calls(template: str) -> bool:
    return "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template)


LLAMA3_JSON = ToolFormat(
    "llama3_json",
    Framing(trigger=None, separator=";"),
    detect=_writes_llama_calls,
    grammar=grammar,
)
