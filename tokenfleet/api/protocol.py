"""OpenAI-compatible request bodies (plus vLLM's extensions) and their mapping onto SamplingParams.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do, so clients written for OpenAI or vLLM
run unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tokenfleet.api.errors import bad_request
from tokenfleet.api.structured_output import StructuredOutputFields
from tokenfleet.api.tool_parsers import format_for_template
from tokenfleet.api.tool_parsers.format import ToolFormat
from tokenfleet.api.tools import ToolFields, arguments_object
from tokenfleet.engine.request import SamplingParams, StructuredOutput

MAX_N = 128
# One request's fan-out: every choice is an engine request and a stream the gateway relays, so a single request
# must not be able to cost seconds of the event loop that serves everyone.
MAX_PROMPTS = 256
MAX_CHOICES = 1024  # n x prompts
OFF_LOOP_CHARS = 4096  # text longer than this is tokenized on a worker thread
MAX_TOKEN_ID = 2**31 - 1  # beyond any vocabulary; checked against the model's own vocabulary later
# torch's generators take seeds in [-2**63, 2**64)
MIN_SEED, SEED_LIMIT = -(2**63), 2**64

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk (the gateway meters cancels by it)


class _SamplingFields(StructuredOutputFields):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=MIN_SEED, lt=SEED_LIMIT)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM extensions
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop_token_ids: list[TokenId] | None = None
    priority: int = 0
    return_token_ids: bool = False  # each choice's generated token ids beside its text (the gateway's failover)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str] | None:
        if isinstance(value, str):
            value = [value]
        if value is not None and any(not s for s in value):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                structured_output=self.structured_output(),
            )
        except ValueError as e:
            raise bad_request(str(e)) from e


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    """A call an assistant message made, as a client sends it back in the history."""

    model_config = ConfigDict(extra="ignore")
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: CalledFunction


# variables a template gets from the request itself, which chat_template_kwargs may not replace
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "chat_template")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's: the call it answers
    reasoning_content: str | None = None  # an assistant's thinking, for templates that keep it

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def template_message(self, tool_format: ToolFormat | None) -> dict:
        """The message as chat templates read it (transformers' conventions: arguments as a mapping)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call, tool_format) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = _history_id(self.tool_call_id, tool_format)
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        unsupported = [p.type for p in self.content if p.type != "text"]
        if unsupported:
            raise bad_request(
                f"content parts of type {unsupported[0]!r} are not supported; send text", param="messages"
            )
        return "".join(p.text or "" for p in self.content)


def _template_call(call: MessageToolCall, tool_format: ToolFormat | None) -> dict:
    function = {"name": call.function.name, "arguments": arguments_object(call.function.arguments)}
    return {"id": _history_id(call.id, tool_format), "type": "function", "function": function}


def _history_id(call_id: str, tool_format: ToolFormat | None) -> str:
    return tool_format.history_id(call_id) if tool_format is not None else call_id


class ChatCompletionRequest(_SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # variables for the template, e.g. {"enable_thinking": false}

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(value or {}) & set(RESERVED_TEMPLATE_VARIABLES))
        if reserved:
            raise ValueError(f"{', '.join(reserved)} come from the request itself, not from chat_template_kwargs")
        return value

    def template_messages(self, tool_format: ToolFormat | None = None) -> list[dict]:
        return [m.template_message(tool_format) for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        """The tools as the template renders them (OpenAI's shape, which chat templates are written for)."""
        return self.tools or None

    def render_chat(self, tokenizer) -> list[int]:
        """The prompt: the model's chat template over the messages, with the tools and chat_template_kwargs."""
        tools = self.template_tools()
        tool_format = format_for_template(tokenizer.template_source(tools is not None))
        return tokenizer.encode_chat(
            self.template_messages(tool_format),
            add_generation_prompt=self.add_generation_prompt,
            tools=tools,
            **(self.chat_template_kwargs or {}),
        )

    def structured_output(self) -> StructuredOutput | None:
        """Also checks the tools (wherever the request is validated for our replicas): a forced call's grammar takes
        the place of a structured output, so both at once is a 400."""
        spec = super().structured_output()
        tools = self.tool_request()
        if tools is not None and tools.forced and spec is not None:
            raise bad_request(
                f"tool_choice: {self.tool_choice if isinstance(self.tool_choice, str) else 'a named function'} "
                "makes the model call a tool, which a response_format or structured output cannot constrain too",
                param="tool_choice",
            )
        return spec

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _not_too_many_prompts(cls, body: object) -> object:
        """Before the fields are validated: that alone takes seconds for a few hundred thousand prompts."""
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
            _check_fan_out(len(prompt), 1)
        return body

    @field_validator("prompt")
    @classmethod
    def _token_ids_in_range(cls, prompt: str | list) -> str | list:
        for ids in _token_lists(prompt):
            bad = next((t for t in ids if not 0 <= t <= MAX_TOKEN_ID), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is out of range: token ids are integers from 0 to {MAX_TOKEN_ID}")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string, several, one token list or several (at most MAX_CHOICES choices)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        _check_fan_out(len(prompt), self.n)
        return list(prompt)


def _token_lists(prompt: str | list) -> list[list[int]]:
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], str):
        return []
    return [prompt] if isinstance(prompt[0], int) else prompt


def _check_fan_out(prompts: int, n: int) -> None:
    if prompts > MAX_PROMPTS:
        raise bad_request(
            f"prompt: {prompts} prompts in one request; the most is {MAX_PROMPTS}",
            param="prompt",
            code="too_many_prompts",
        )
    if prompts * n > MAX_CHOICES:
        raise bad_request(
            f"n: {n} choices for each of {prompts} prompts make {prompts * n}; the most is "
            f"{MAX_CHOICES} choices per request",
            param="n",
            code="too_many_choices",
        )


def parse(model: type[BaseModel], body: object) -> BaseModel:
    """Validates a decoded JSON body; errors become a 400 naming the offending field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise bad_request(f"{param}: {message}" if param else message, param=param) from None


async def prompt_token_ids_off_loop(req: ChatCompletionRequest | CompletionRequest, tokenizer) -> list[list[int]]:
    """prompt_token_ids, on a worker thread when the text is long: encoding takes milliseconds per thousand
    characters, and on the event loop every other request would wait for it."""
    if _text_chars(req) <= OFF_LOOP_CHARS:
        return prompt_token_ids(req, tokenizer)
    return await asyncio.to_thread(prompt_token_ids, req, tokenizer)


def _text_chars(req: ChatCompletionRequest | CompletionRequest) -> int:
    if isinstance(req, ChatCompletionRequest):
        return sum(len(m.text()) for m in req.messages) + (len(str(req.tools)) if req.tools else 0)
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    return sum(len(p) for p in prompts if isinstance(p, str))


def prompt_token_ids(req: ChatCompletionRequest | CompletionRequest, tokenizer) -> list[list[int]]:
    """The request's prompts as token ids: the chat template rendered and encoded, or each text prompt encoded
    (token-id prompts pass through). Used by the replica and by the gateway, which counts tokens up front."""
    if isinstance(req, ChatCompletionRequest):
        if tokenizer is None:
            raise bad_request("this server has no tokenizer; use /v1/completions with token ids")
        try:
            return [req.render_chat(tokenizer)]
        except (
            ValueError,
            TypeError,
            jinja2.TemplateError,
        ) as e:  # e.g. the template's raise_exception on a conversation
            raise bad_request(f"the model's chat template refused these messages: {e}", param="messages") from e
    prompts = []
    for prompt in req.prompts():
        if isinstance(prompt, str):
            if tokenizer is None:
                raise bad_request("this server has no tokenizer; send the prompt as token ids", param="prompt")
            prompt = tokenizer.encode(prompt)
        prompts.append(prompt)
    return prompts
