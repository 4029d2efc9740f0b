"""The request fields that constrain the output's shape, and the one StructuredOutput they make.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar`, `json_object`) and vLLM's older `guided_json`, `guided_regex`, `guided_choice` and
`guided_grammar`. At most one of them may constrain a request. Parsing checks only their shape (the gateway parses
bodies too, also for external OpenAI-compatible replicas, which may support more); `structured_output()` is the
replica's: anything we cannot enforce, from an unsupported option to a schema keyword the grammar engine lacks, is
a 400 naming the field, never a silently ignored constraint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenfleet.api.errors import APIError, bad_request
from tokenfleet.engine.request import StructuredOutput
from tokenfleet.engine.structured import GrammarError, check_structured_output

# vLLM's structured_outputs options beyond the constraint itself: none of them is honoured here, so none is accepted
_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema. `strict` may be true or false: the schema is always enforced in full."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]  # structural_tag: vLLM's, not ours
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is json_schema")
        return self


class StructuredOutputsOptions(BaseModel):
    """vLLM's structured_outputs. Its other options (whitespace_pattern, structural_tag, ...) are kept to be named
    in the replica's 400."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredOutputFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsOptions | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # not honoured: a 400 on our replica
    guided_decoding_backend: str | None = None  # vLLM's choice of grammar engine; ours is always llguidance

    def structured_output(self) -> StructuredOutput | None:
        """The request's structured output, checked by the grammar engine; a 400 naming the field otherwise."""
        if self.guided_whitespace_pattern is not None:
            raise _unsupported("guided_whitespace_pattern")
        found = [(param, make) for param, make in self._constraints() if make is not None]
        if len(found) > 1:
            names = ", ".join(param for param, _ in found)
            raise bad_request(
                f"{found[1][0]}: only one structured output per request; this one has {names}", param=found[1][0]
            )
        if not found:
            return None
        param, make = found[0]
        try:
            spec = make()
            check_structured_output(spec)
        except (GrammarError, ValueError) as e:
            raise self._invalid(param, e) from None
        return spec

    def structured_output_error(self, error: GrammarError) -> APIError:
        """The 400 for what the engine refused of this request's structured output (what only its tokenizer can
        tell, e.g. a special token the vocabulary lacks), naming the field it came from."""
        params = [param for param, make in self._constraints() if make is not None]
        return self._invalid(params[0] if params else "response_format", error)

    def _invalid(self, param: str, error: Exception) -> APIError:
        """OpenAI's words for a bad response_format schema; the same shape for the other fields."""
        rf = self.response_format
        if param == "response_format" and rf is not None and rf.json_schema is not None:
            what = f"Invalid schema for response_format '{rf.json_schema.name}'"
        else:
            what = f"Invalid {param}"
        return bad_request(f"{what}: {error}", param=param, code="invalid_structured_output")

    def _constraints(self) -> list[tuple[str, Callable[[], StructuredOutput] | None]]:
        return [
            ("response_format", self._from_response_format()),
            ("structured_outputs", self._from_structured_outputs()),
            ("guided_json", _json_schema_maker(self.guided_json)),
            ("guided_regex", None if self.guided_regex is None else lambda: StructuredOutput.regex(self.guided_regex)),
            ("guided_choice", _choice_maker(self.guided_choice)),
            ("guided_grammar", _grammar_maker(self.guided_grammar)),
        ]

    def _from_response_format(self) -> Callable[[], StructuredOutput] | None:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutput.json_object
        if rf.type == "structural_tag":
            raise _unsupported("response_format", "type structural_tag")
        assert rf.json_schema is not None  # the model's validator
        if rf.json_schema.schema_ is None:
            raise bad_request(
                "response_format.json_schema.schema is required: the JSON schema the output must match",
                param="response_format",
            )
        return _json_schema_maker(rf.json_schema.schema_)

    def _from_structured_outputs(self) -> Callable[[], StructuredOutput] | None:
        so = self.structured_outputs
        if so is None:
            return None
        unsupported = sorted(k for k, v in (so.model_extra or {}).items() if v not in (None, False))
        if unsupported:
            raise _unsupported("structured_outputs", ", ".join(unsupported))
        makers = {
            "json": _json_schema_maker(so.json_),
            "regex": None if so.regex is None else lambda: StructuredOutput.regex(so.regex),  # type: ignore[arg-type]
            "choice": _choice_maker(so.choice),
            "grammar": _grammar_maker(so.grammar),
            "json_object": StructuredOutput.json_object if so.json_object else None,
        }
        given = [key for key in _CONSTRAINT_KEYS if makers[key] is not None]
        if len(given) != 1:
            raise bad_request(
                f"structured_outputs: give exactly one of {', '.join(_CONSTRAINT_KEYS)}"
                + (f" (got {', '.join(given)})" if given else ""),
                param="structured_outputs",
            )
        return makers[given[0]]


def _json_schema_maker(schema: dict[str, Any] | str | None) -> Callable[[], StructuredOutput] | None:
    return None if schema is None else lambda: StructuredOutput.json_schema(schema)


def _choice_maker(choices: list[str] | None) -> Callable[[], StructuredOutput] | None:
    return None if choices is None else lambda: StructuredOutput.choice(choices)


def _grammar_maker(grammar: str | None) -> Callable[[], StructuredOutput] | None:
    return None if grammar is None else lambda: StructuredOutput.grammar(grammar)


def _unsupported(param: str, what: str | None = None) -> APIError:
    detail = f"{param}: {what} is not supported" if what else f"{param} is not supported"
    return bad_request(detail, param=param, code="unsupported_parameter")
