"""A `POST /v1/responses` body: validated like OpenAI's, then turned into the chat messages and the chat completion
body that the gateway serves. A parameter that OpenAI defines and we do not implement is a 400 naming it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenfleet.api.errors import bad_request

ROLES = ("user", "assistant", "system", "developer")


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    """A message item: `{"role", "content"}`, optionally typed "message" (also a previous response's output)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat = TextFormat()


class ResponseCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[InputMessage | dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    text: TextOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # defined by OpenAI, not served here: a 400 naming the parameter when it asks for anything
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    conversation: Any = None
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM's extension, as on its chat API: generate to max_output_tokens

    def check_supported(self) -> None:
        unsupported = {
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none", "auto"),
            "background": bool(self.background),
            "include": bool(self.include),
            "reasoning": bool(self.reasoning),
            "top_logprobs": bool(self.top_logprobs),
            "max_tool_calls": self.max_tool_calls is not None,
            "prompt": self.prompt is not None,
            "conversation": self.conversation is not None,
            "truncation": self.truncation == "auto",
        }
        for param, asked in unsupported.items():
            if asked:
                raise bad_request(f"{param} is not supported by this server", param=param, code="unsupported_parameter")

    def messages(self) -> list[dict]:
        """This request's input as chat messages (without the instructions, which are not carried to the next
        response of a chain)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out = []
        for index, item in enumerate(self.input):
            if not isinstance(item, InputMessage):
                kind = item.get("type", "an item without a role")
                raise bad_request(f"input[{index}]: {kind} items are not supported", param=f"input.{index}")
            out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        if not out:
            raise bad_request("input must not be empty", param="input")
        return out

    def chat_body(self, history: list[dict]) -> dict:
        """The chat completion the gateway serves: the instructions, the chain's earlier turns, this input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            "model": self.model,
            "messages": system + history + self.messages(),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for name, value in (
            ("max_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
        ):
            if value is not None:
                body[name] = value
        if self.ignore_eos:
            body["ignore_eos"] = True
        response_format = self._response_format()
        if response_format is not None:
            body["response_format"] = response_format
        return body

    def head(self) -> dict:
        """The response object's fields that this request sets."""
        return {
            "model": self.model,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "previous_response_id": self.previous_response_id,
            "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls,
            "tool_choice": "auto",
            "tools": [],
            "text": {"format": self._text_format()},
            "reasoning": {"effort": None, "summary": None},
            "truncation": "disabled",
            "store": self.store,
            "metadata": self.metadata or {},
            "user": self.user,
        }

    def _text_format(self) -> dict:
        fmt = self.text.format if self.text is not None else TextFormat()
        return fmt.model_dump(by_alias=True, exclude_none=True)

    def _response_format(self) -> dict | None:
        fmt = self.text.format if self.text is not None else TextFormat()
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise bad_request("text.format.schema is required for json_schema", param="text.format.schema")
            schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": bool(fmt.strict)}
            return {"type": "json_schema", "json_schema": schema}
        return None
