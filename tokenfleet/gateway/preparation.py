"""A request before admission: its body parsed, its model resolved (aliases, product rules, canary), its prompts
tokenized with that model's tokenizer and checked against its context window, all before anything reaches a
replica; and the same again when the overload ladder moves it to another model."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from tokenfleet.api.errors import bad_request, not_found
from tokenfleet.api.protocol import ChatCompletionRequest, CompletionRequest, parse, prompt_token_ids_off_loop
from tokenfleet.gateway.auth import Caller
from tokenfleet.model.tokenizer import Tokenizer
from tokenfleet.router.catalog import RequestFacts, Resolution
from tokenfleet.router.router import Router

Body = ChatCompletionRequest | CompletionRequest


@dataclass
class ModelInfo:
    name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int | None = None  # the model's (its config's); token-id prompts are checked against it


@dataclass
class Prepared:
    """A request that passed validation: its model, its prompts as tokens, and the body a replica will get."""

    request_id: str
    kind: str
    req: Body
    body: dict
    resolution: Resolution
    prompts: list[list[int]]
    arrived: float = field(default_factory=time.monotonic)  # for the usage record's latency and TTFT

    @property
    def choices(self) -> int:
        return self.req.n * len(self.prompts)

    @property
    def model(self) -> str:
        return self.resolution.model.name

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def max_tokens(self) -> int | None:
        return max_tokens_of(self.kind, self.req)


class RequestPreparation:
    def __init__(self, models: dict[str, ModelInfo], router: Router) -> None:
        self.models, self.router = models, router

    async def prepare(self, kind: str, body: dict, caller: Caller, mode: str | None = None) -> Prepared:
        """Parses the body, resolves the model, tokenizes the prompt(s) with that model's tokenizer and checks
        them against its context window."""
        req = parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, body)
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        first = self._tokenizer_for(req.model)
        prompts = await prompt_token_ids_off_loop(req, first.tokenizer)
        facts = RequestFacts(len(prompts[0]), _has_attachments(body), mode or body.get("mode"))
        resolution = self.router.resolve(req.model, facts, caller.principal.tier, request_id)
        info = self.models[resolution.model.name]
        if info.tokenizer is not first.tokenizer:
            prompts = await prompt_token_ids_off_loop(req, info.tokenizer)
        self._check_window(kind, req, prompts, info)
        if self._all_ours(info.name):  # an external OpenAI server may allow more; ours answer what this checks
            req.structured_output()  # a schema we cannot enforce is a 400 now, not an error event in a 200 stream
        return Prepared(request_id, kind, req, {**body, "model": info.name}, resolution, prompts)

    async def reroute(self, p: Prepared, model: str, why: str) -> None:
        """Moves a prepared request to another model (the overload ladder sends free users to the smaller one)."""
        spec = self.router.catalog.lookup(model)
        if spec is None:
            raise not_found(f"The model `{model}` does not exist", param="model", code="model_not_found")
        info = self.models[spec.name]
        if info.tokenizer is not self.models[p.model].tokenizer:
            p.prompts = await prompt_token_ids_off_loop(p.req, info.tokenizer)
        self._check_window(p.kind, p.req, p.prompts, info)
        p.resolution = Resolution(spec, p.resolution.requested, why, spec.deprecated_on)
        p.body = {**p.body, "model": spec.name}

    def _all_ours(self, model: str) -> bool:
        replicas = self.router.pools_for(model).replicas.values()
        return bool(replicas) and all(r.kind == "tokenfleet" for r in replicas)

    def _tokenizer_for(self, requested: str) -> ModelInfo:
        """The named model's, or for a routing alias its first rule's (to count the tokens its rules look at)."""
        rules = self.router.catalog.router_aliases.get(requested)
        spec = self.router.catalog.lookup(rules[0].model if rules else requested)
        if spec is None:
            raise not_found(f"The model `{requested}` does not exist", param="model", code="model_not_found")
        return self.models[spec.name]

    def _check_window(self, kind: str, req: Body, prompts: list[list[int]], info: ModelInfo) -> None:
        max_tokens, param = max_tokens_of(kind, req), "messages" if kind == "chat" else "prompt"
        for prompt in prompts:
            if not prompt:
                raise bad_request("the prompt is empty", param=param)
            if info.vocab_size is not None and max(prompt) >= info.vocab_size:
                raise bad_request(
                    f"prompt token id {max(prompt)} is outside the vocabulary (0..{info.vocab_size - 1})", param=param
                )
            if len(prompt) + (max_tokens or 1) > info.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {info.max_model_len} tokens; you "
                    f"requested {len(prompt) + (max_tokens or 1)} tokens ({len(prompt)} in the "
                    f"prompt, {max_tokens or 1} to generate)",
                    param=param,
                    code="context_length_exceeded",
                )


def max_tokens_of(kind: str, req: Body) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return req.requested_max_tokens()
    return req.max_tokens


def _has_attachments(body: dict) -> bool:
    return any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(part, dict) and part.get("type") != "text" for part in m["content"])
        for m in body.get("messages") or []
    )
