"""Tool-call formats, one module each, and the one a chat template writes."""

from __future__ import annotations

from tokenfleet.api.tool_parsers.format import ToolFormat
from tokenfleet.api.tool_parsers.hermes import HERMES
from tokenfleet.api.tool_parsers.llama3_json import LLAMA3_JSON
from tokenfleet.api.tool_parsers.mistral import MISTRAL, MISTRAL_V11

FORMATS: tuple[ToolFormat, ...] = (HERMES, MISTRAL_V11, MISTRAL, LLAMA3_JSON)  # the first that detects wins


def format_for_template(template: str | None) -> ToolFormat | None:
    """The format whose calls the template writes (and reads back), or None: then it has no tools we can parse."""
    if not template:
        return None
    return next((fmt for fmt in FORMATS if fmt.detect(template)), None)
