"""A `POST /v1/responses` body: validated like OpenAI's, then turned into the chat messages and the chat completion
body that the gateway serves. A parameter that OpenAI defines and we do not implement is a 400 naming it.

Function tools become the chat API's tools (the replica renders and parses them); `function_call` input items
become an assistant message's tool_calls, `reasoning` items its reasoning_content, and `function_call_output` items
tool messages, so a tool round trip, in one request or across previous_response_id, reads back as the chat
template expects."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class FunctionCallItem(BaseModel):
    """A call the model made (a previous response's output item, sent back as input)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str

    def tool_call(self) -> dict:
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class FunctionCallOutputItem(BaseModel):
    """What the caller's function returned for a call."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]

    def message(self) -> dict:
        text = self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)
        return {"role": "tool", "tool_call_id": self.call_id, "content": text}


class ReasoningText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(BaseModel):
    """The model's thinking (a previous response's output item, sent back as input, as OpenAI asks of callers who
    manage the context themselves); its summary, which we never write, is not read."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = []
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


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
    input: str | list[InputItem | dict[str, Any]]
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
    tools: list[dict[str, Any]] | None = None  # function tools (others are a 400 naming them)
    tool_choice: str | dict[str, Any] | None = None
    # defined by OpenAI, not served here: a 400 naming the parameter when it asks for anything
    background: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    conversation: Any = None
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM's extension, as on its chat API: generate to max_output_tokens
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's too: e.g. {"enable_thinking": false}
    structured_outputs: dict[str, Any] | None = None  # vLLM's too (regex, choice, grammar...): checked by the chat API

    def check_supported(self) -> None:
        unsupported = {
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
        self.function_tools()
        self.chat_tool_choice()

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for index, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise bad_request(
                    f"tools[{index}]: tools of type {str(kind)[:40]!r} are not supported; only function tools are",
                    param="tools",
                    code="unsupported_parameter",
                )
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise bad_request(f"tools[{index}].{where}: {first['msg']}", param="tools") from None
        return tools

    def chat_tool_choice(self) -> str | dict | None:
        """tool_choice in the chat API's shape: a named function is {"type": "function", "name"} here."""
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise bad_request(
            'tool_choice: only "none", "auto", "required" or {"type": "function", "name": ...} are supported',
            param="tool_choice",
            code="unsupported_parameter",
        )

    def messages(self) -> list[dict]:
        """This request's input as chat messages (without the instructions, which are not carried to the next
        response of a chain)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict] = []
        for index, item in enumerate(self.input):
            if isinstance(item, FunctionCallItem):
                _add_call(out, item)
            elif isinstance(item, FunctionCallOutputItem):
                out.append(item.message())
            elif isinstance(item, ReasoningItem):
                out.append({"role": "assistant", "content": None, "reasoning_content": item.text()})
            elif isinstance(item, InputMessage) and item.role == "assistant":
                _add_assistant_text(out, item.text())
            elif isinstance(item, InputMessage):
                out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
            else:
                kind = item.get("type", "an item without a role")
                raise bad_request(f"input[{index}]: {kind} items are not supported", param=f"input.{index}")
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
        if self.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        if self.structured_outputs is not None:
            body["structured_outputs"] = self.structured_outputs
        tools = self.function_tools()
        if tools:
            body["tools"] = [tool.chat_tool() for tool in tools]
        for name, value in (
            ("tool_choice", self.chat_tool_choice()),
            ("parallel_tool_calls", self.parallel_tool_calls),
        ):
            if value is not None:
                body[name] = value
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
            "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
            "tools": [tool.model_dump() for tool in self.function_tools()],
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


def _add_assistant_text(messages: list[dict], text: str) -> None:
    """An assistant's text joins its reasoning right before it, as one message."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and last["content"] is None and "tool_calls" not in last:
        last["content"] = text
    else:
        messages.append({"role": "assistant", "content": text})


def _add_call(messages: list[dict], item: FunctionCallItem) -> None:
    """Calls join the assistant message right before them (its text, or the calls before), as in the chat API."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        messages.append(last)
    last.setdefault("tool_calls", []).append(item.tool_call())
