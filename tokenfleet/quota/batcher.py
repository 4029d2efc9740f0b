"""Micro-batching: the calls made within one event-loop tick are handed on together, so N concurrent requests cost one
Redis round trip instead of N. A call waits for nothing but the end of the current tick (no timer): alone, it goes
out as soon as it would have; in a burst, it shares the trip with every call the same tick made.

The batch function gets the calls in the order they were made and answers each with its result or its exception;
each caller gets its own answer. A call whose caller was cancelled before its batch went out is left out of it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
# the answer of each call, in order: its result, or the exception its caller gets
Flush = Callable[[list[Item]], Awaitable[Sequence[object]]]


class TickBatcher(Generic[Item]):
    def __init__(self, flush: Flush[Item], max_batch: int = 128) -> None:
        """`max_batch`: the most calls one flush gets; a larger tick's calls go out as several flushes, at once."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.flush, self.max_batch = flush, max_batch
        self.batches = 0  # flushes made (for tests and benchmarks: calls / batches is the coalescing achieved)
        self._items: list[Item] = []
        self._futures: list[asyncio.Future[object]] = []
        self._scheduled_on: asyncio.AbstractEventLoop | None = None
        self._running: set[asyncio.Task[None]] = set()

    def submit(self, item: Item) -> asyncio.Future[object]:
        """Queues the call for the end of this tick; the future resolves with its answer."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._items.append(item)
        self._futures.append(future)
        if self._scheduled_on is not loop:
            self._scheduled_on = loop
            task = loop.create_task(self._tick())  # its first step runs on the loop's next turn, as call_soon would
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        return future

    async def wait_idle(self) -> None:
        """Until every batch that went out has been answered."""
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    async def _tick(self) -> None:
        """The tick's calls: the first batch flushed by this task itself (no further turn of the loop before it goes
        out), any others by tasks of their own, at the same time."""
        items, futures = self._items, self._futures
        self._items, self._futures, self._scheduled_on = [], [], None
        live = [i for i, future in enumerate(futures) if not future.done()]  # done: its caller was cancelled
        batches = [live[start : start + self.max_batch] for start in range(0, len(live), self.max_batch)]
        for chosen in batches[1:]:
            task = asyncio.get_running_loop().create_task(
                self._answer([items[i] for i in chosen], [futures[i] for i in chosen])
            )
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        if batches:
            await self._answer([items[i] for i in batches[0]], [futures[i] for i in batches[0]])

    async def _answer(self, items: list[Item], futures: list[asyncio.Future[object]]) -> None:
        self.batches += 1
        try:
            answers = await self.flush(items)
            if len(answers) != len(items):
                raise RuntimeError(f"a batch of {len(items)} calls got {len(answers)} answers")
        except Exception as e:  # failed as a whole: every caller gets the error
            for future in futures:
                if not future.done():
                    future.set_exception(e)
            return
        except BaseException:  # cancelled (the loop is shutting down): so are the callers
            for future in futures:
                future.cancel()
            raise
        for future, answer in zip(futures, answers):
            if future.done():  # its caller was cancelled meanwhile
                continue
            if isinstance(answer, BaseException):
                future.set_exception(answer)
            else:
                future.set_result(answer)
