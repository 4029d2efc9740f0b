"""OpenAI request parameters that this engine does not serve. Accepting them with a 200 and ignoring them is the
worst answer (an agent's functions silently never called), so a replica of ours refuses each by name with OpenAI's
400. The gateway does not check them: to an external OpenAI-compatible replica (vLLM, SGLang) they pass as sent."""

from __future__ import annotations

from collections.abc import Callable

from tokenfleet.api.errors import bad_request

# parameter -> whether a value asks for something (a default or empty value asks for nothing)
Asks = Callable[[object], bool]
_ANY: Asks = lambda value: value not in (None, False, [], {}, "")  # noqa: E731
# tools, tool_choice and parallel_tool_calls are served (api/tools.py); the deprecated functions API is not
CHAT: dict[str, Asks] = {
    "functions": _ANY,
    "function_call": lambda value: value not in (None, "none", "auto"),
    "logit_bias": _ANY,
    "audio": _ANY,
    "modalities": lambda value: value not in (None, ["text"]),
    "prediction": _ANY,
    "web_search_options": _ANY,
    "store": _ANY,
}
TEXT: dict[str, Asks] = {
    "logit_bias": _ANY,
    "best_of": lambda value: value not in (None, 1),
}


def reject_unsupported(kind: str, body: object) -> None:
    """A 400 naming the first parameter in `body` that asks for what we do not serve (kind: chat | text)."""
    if not isinstance(body, dict):
        return
    for param, asks in (CHAT if kind == "chat" else TEXT).items():
        if param in body and asks(body[param]):
            raise bad_request(f"{param} is not supported by this server", param=param, code="unsupported_parameter")
