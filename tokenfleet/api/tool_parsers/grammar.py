"""The grammar that makes a model call a tool (tool_choice `required` or a named function): the format's own call
syntax in Lark, each call's JSON constrained by a JSON schema (llguidance's `%json`) that allows only the request's
tool names, each with its own parameters' schema. The engine's structured output enforces it token by token, so
the arguments validate whatever the weights."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenfleet.engine.structured import JSON_WHITESPACE
from tokenfleet.model.tokenizer import Tokenizer

# a function without parameters takes an empty object
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    parameters: dict[str, Any] | None  # its JSON schema; None: no parameters


@dataclass(frozen=True)
class CallsGrammar:
    """What the grammar must allow: calls to these functions (one, or one or more when parallel), after
    `prefix` (a Lark expression, "" for none; `prefix_rules` defines what it names: the model's thinking)."""

    functions: Sequence[FunctionSpec]
    parallel: bool
    prefix: str = ""
    prefix_rules: str = ""

    def start(self, calls: str) -> str:
        return f"start: {self.prefix} {calls}\n" if self.prefix else f"start: {calls}\n"


def call_schema(functions: Sequence[FunctionSpec], arguments_key: str) -> dict[str, Any]:
    """One call's JSON: `{"name": <one of the functions>, arguments_key: <its parameters>}`, in that order."""
    definitions, variants = {}, []
    for i, function in enumerate(functions):
        where = f"#/$defs/tool_{i}"
        definitions[f"tool_{i}"] = _rebased(function.parameters or NO_PARAMETERS, where)
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": function.name}, arguments_key: {"$ref": where}},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    one = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**one, "$defs": definitions}


def with_whitespace(schema: dict[str, Any]) -> dict[str, Any]:
    """The engine's JSON whitespace (none or one space between tokens) for a `%json` block of a Lark grammar."""
    return {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


def lark_json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(with_whitespace(schema), ensure_ascii=False)


def lark_literal(text: str, tokenizer: Tokenizer | None = None) -> str:
    """A literal of the call syntax: the special token itself where the vocabulary has it as one (Mistral's
    `[TOOL_CALLS]`; its characters would spell other tokens), else the text."""
    if tokenizer is not None:
        token_id = tokenizer.token_to_id(text)
        if token_id is not None and token_id in tokenizer.all_special_ids:
            return f"<[{token_id}]>"
    return json.dumps(text, ensure_ascii=False)


def _rebased(node: Any, where: str) -> Any:
    """The schema moved under `where`: its own references (`#`, `#/$defs/...`) point into its new place."""
    if isinstance(node, dict):
        return {
            key: where + value[1:]
            if key == "$ref" and isinstance(value, str) and value.startswith("#")
            else _rebased(value, where)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_rebased(item, where) for item in node]
    return node
