"""OpenAI-compatible request bodies (plus vLLM's extensions) and their mapping onto SamplingParams.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do, so clients written for OpenAI or vLLM
run unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tokenfleet.api.errors import bad_request
from tokenfleet.api.structured_output import StructuredOutputFields
from tokenfleet.engine.request import SamplingParams

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        unsupported = [p.type for p in self.content if p.type != "text"]
        if unsupported:
            raise bad_request(
                f"content parts of type {unsupported[0]!r} are not supported; send text", param="messages"
            )
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    def template_messages(self) -> list[dict]:
        return [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(),
                **({"name": m.name} if m.name else {}),
            }
            for m in self.messages
        ]

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
        return sum(len(m.text()) for m in req.messages)
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    return sum(len(p) for p in prompts if isinstance(p, str))


def prompt_token_ids(req: ChatCompletionRequest | CompletionRequest, tokenizer) -> list[list[int]]:
    """The request's prompts as token ids: the chat template rendered and encoded, or each text prompt encoded
    (token-id prompts pass through). Used by the replica and by the gateway, which counts tokens up front."""
    if isinstance(req, ChatCompletionRequest):
        if tokenizer is None:
            raise bad_request("this server has no tokenizer; use /v1/completions with token ids")
        try:
            return [tokenizer.encode_chat(req.template_messages(), add_generation_prompt=req.add_generation_prompt)]
        except (ValueError, jinja2.TemplateError) as e:  # e.g. the template's raise_exception on a conversation
            raise bad_request(f"the model's chat template refused these messages: {e}", param="messages") from e
    prompts = []
    for prompt in req.prompts():
        if isinstance(prompt, str):
            if tokenizer is None:
                raise bad_request("this server has no tokenizer; send the prompt as token ids", param="prompt")
            prompt = tokenizer.encode(prompt)
        prompts.append(prompt)
    return prompts
