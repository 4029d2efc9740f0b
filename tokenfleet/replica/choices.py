"""One API request's choices (n per prompt) as engine requests, merged into one stream of (choice, output)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry.context import Context

from tokenfleet.api.usage import Usage
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.outputs import RequestOutput, RequestTiming
from tokenfleet.engine.request import SamplingParams

_DONE = object()
_START_SLICE = 32  # engine requests started per turn of the event loop


@dataclass
class ChoiceStream:
    engine: AsyncEngine
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    priority: int = 0
    usage: Usage = field(default_factory=Usage)
    finals: dict[int, RequestOutput] = field(default_factory=dict)
    first_token_at: float | None = None
    engine_timing: RequestTiming | None = None  # the first choice's wait in the engine's queue and its prefill
    gaps: list[float] = field(default_factory=list)  # seconds between successive tokens of each choice
    _last_token_at: dict[int, float] = field(default_factory=dict)
    _engine_s: dict[int, float] = field(default_factory=dict)  # per choice, as last reported
    trace_parent: Context | None = None  # the trace its spans continue (the gateway's routing attempt)

    def __post_init__(self) -> None:
        self.usage.prompt_tokens = sum(len(p) for p in self.prompts)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yields (choice index, output) as any choice progresses; closing it aborts the unfinished choices."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Task] = []
        try:
            await self._start_pumps(queue, tasks)
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for task in tasks:
                task.cancel()  # each pump's generator aborts its engine request when cancelled
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _start_pumps(self, queue: asyncio.Queue, tasks: list[asyncio.Task]) -> None:
        """One engine request per choice, started a slice at a time: each start costs the event loop a little (a
        command to the engine), and a request with a thousand choices must not hold it for everyone else."""
        choices = enumerate(p for p in self.prompts for _ in range(self.n))
        while slice_ := list(itertools.islice(choices, _START_SLICE)):
            tasks.extend(asyncio.create_task(self._pump(i, prompt, queue)) for i, prompt in slice_)
            await asyncio.sleep(0)

    def _choice_params(self, index: int) -> SamplingParams:
        """A seeded request's choices get consecutive seeds: reproducible, yet not n copies of one sample."""
        if self.params.seed is None or index % self.n == 0:
            return self.params
        return dataclasses.replace(self.params, seed=self.params.seed + index % self.n)

    async def _pump(self, index: int, prompt: list[int], queue: asyncio.Queue) -> None:
        try:
            params = self._choice_params(index)
            async for out in self.engine.generate(prompt, params, f"{self.request_id}-{index}", self.priority):
                self._account(index, out)
                queue.put_nowait((index, out))
        except Exception as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_DONE)

    def _account(self, index: int, out: RequestOutput) -> None:
        """Usage counted as tokens arrive, so the count on every chunk is exact when a stream is cut short."""
        if out.timing is not None and self.engine_timing is None:
            self.engine_timing = out.timing
        if index not in self._engine_s and index % self.n == 0:  # each prompt's cache hits once, like its tokens
            self.usage.cached_tokens += out.num_cached_tokens
        self.usage.engine_s += out.engine_s - self._engine_s.get(index, 0.0)
        self._engine_s[index] = out.engine_s
        if out.new_token_ids:
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
            if index in self._last_token_at:
                self.gaps.append(now - self._last_token_at[index])
            self._last_token_at[index] = now
            self.usage.completion_tokens += len(out.new_token_ids)
        if out.finished:
            self.finals[index] = out

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n
