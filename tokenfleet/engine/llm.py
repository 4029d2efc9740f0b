"""The offline front door: `LLM(model=DIR).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.engine import Engine, RequestOutput
from tokenfleet.engine.request import SamplingParams

Prompt = str | dict[str, list[int]]  # a string or {"prompt_token_ids": [...]}


class LLM:
    def __init__(self, model: str, **engine_options: Any) -> None:
        config = EngineConfig.from_options(model, **engine_options)
        if config.threads > 0:
            import torch

            torch.set_num_threads(config.threads)
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion with continuous batching; results come back in prompt order.

        A prompt is a string or {"prompt_token_ids": [...]}; `sampling_params` is one for all or one per prompt.
        """
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        ids: list[str] = []
        try:
            for prompt, sp, pr in zip(prompts, params, priorities, strict=True):
                ids.append(self.engine.add_request(_prompt_input(prompt), sp, priority=pr).request_id)
        except Exception:
            for request_id in ids:  # all or nothing
                self.engine.abort(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
        return [results[i] for i in ids]

    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or SamplingParams()] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]  # the engine checks it is a list of token ids
    raise ValueError("a prompt is a string or a dict with 'prompt_token_ids'")
