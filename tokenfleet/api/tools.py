"""A chat request's tools: `tools`, `tool_choice` and `parallel_tool_calls`, parsed loosely (the gateway parses
bodies for external OpenAI-compatible replicas too, which may serve more tool types) and made into one ToolRequest
by our replica, where anything we cannot serve is a 400 naming the field. `required` and a named function are
enforced by a grammar (tool_parsers/grammar.py), so their parameters' schemas must be ones the grammar engine
can enforce; that check needs no tokenizer and runs wherever the request is validated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenfleet.api.errors import APIError, bad_request
from tokenfleet.api.tool_parsers.grammar import FunctionSpec, call_schema
from tokenfleet.engine.request import StructuredOutput
from tokenfleet.engine.structured import GrammarError, check_structured_output

CHOICES = ("none", "auto", "required")
Choice = Literal["none", "auto", "required", "function"]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@dataclass(frozen=True)
class ToolRequest:
    functions: tuple[FunctionSpec, ...]
    choice: Choice
    function: str | None  # the function a named tool_choice calls
    parallel: bool

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.functions)

    @property
    def forced(self) -> bool:
        """The model must call: a grammar makes it."""
        return self.choice in ("required", "function")

    @property
    def callable(self) -> tuple[FunctionSpec, ...]:
        """What the model may call."""
        if self.function is None:
            return self.functions
        return tuple(f for f in self.functions if f.name == self.function)

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1


class ToolFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tool_request(self) -> ToolRequest | None:
        """The request's tools, checked; None when it has none. A 400 naming the field for anything else."""
        functions = tuple(_function(i, tool) for i, tool in enumerate(self.tools or []))
        choice, function = self._choice(functions)
        if not functions:
            if choice in ("required", "function"):
                raise bad_request(
                    "tool_choice: a tool must be called, but the request has no tools", param="tool_choice"
                )
            return None
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise bad_request("tools: two tools have the same name", param="tools")
        # a named function is called exactly once, as OpenAI's "forced function"
        parallel = self.parallel_tool_calls is not False and choice != "function"
        request = ToolRequest(functions, choice, function, parallel)
        if request.forced:
            _check_enforceable(request)
        return request

    def _choice(self, functions: tuple[FunctionSpec, ...]) -> tuple[Choice, str | None]:
        value = self.tool_choice
        if value is None:
            return ("auto" if functions else "none"), None
        if isinstance(value, str):
            if value not in CHOICES:
                raise bad_request(
                    f"tool_choice: {value[:40]!r} is not one of none, auto, required or a named function",
                    param="tool_choice",
                )
            return value, None  # type: ignore[return-value]
        name = _named_function(value)
        if functions and name not in {f.name for f in functions}:
            raise bad_request(f"tool_choice: the function {name[:64]!r} is not in tools", param="tool_choice")
        return "function", name


def _function(index: int, tool: dict[str, Any]) -> FunctionSpec:
    kind = tool.get("type", "function")
    if kind != "function":
        raise bad_request(
            f"tools[{index}]: tools of type {str(kind)[:40]!r} are not supported; only function tools are",
            param="tools",
            code="unsupported_parameter",
        )
    try:
        definition = FunctionDefinition.model_validate(tool.get("function"))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(
            f"tools[{index}].function{'.' + where if where else ''}: {first['msg']}", param="tools"
        ) from None
    return FunctionSpec(definition.name, definition.parameters)


def _named_function(value: dict[str, Any]) -> str:
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if value.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}; other kinds are not '
            "supported",
            param="tool_choice",
        )
    return name


def _check_enforceable(request: ToolRequest) -> None:
    """Each callable function's parameters must compile as a JSON schema of the grammar engine."""
    try:
        check_structured_output(StructuredOutput.json_schema(call_schema(request.callable, "arguments")))
    except (GrammarError, ValueError) as e:
        raise tools_error(e) from None


def tools_error(error: Exception) -> APIError:
    return bad_request(
        f"Invalid tools: a function's parameters cannot be enforced: {error}",
        param="tools",
        code="invalid_tool_schema",
    )


def arguments_object(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    """A history call's arguments as templates read them (a mapping, as in transformers); text that is not a JSON
    object stays text."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments
