"""AsyncEngine: the step loop on its own thread; each request gets an async stream of outputs and can be aborted.

The loop never waits on a consumer: outputs are handed to the consumer's event loop with call_soon_threadsafe
into an unbounded queue, and aborts arrive through a thread-safe inbox applied before the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar

from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.kv_transfer import KVLayout
from tokenfleet.engine.outputs import RequestOutput
from tokenfleet.engine.request import SamplingParams
from tokenfleet.engine.state import EngineState

if TYPE_CHECKING:
    from tokenfleet.engine.engine import Engine
    from tokenfleet.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)
OutputQueue: TypeAlias = "asyncio.Queue[RequestOutput | BaseException]"  # a request's outputs, or what failed it
Command: TypeAlias = tuple[Any, ...]  # ("add", request_id, prompt, params, priority) | ("abort", request_id) | ...


@dataclass
class StreamQueue:
    loop: asyncio.AbstractEventLoop
    queue: OutputQueue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def put_all(batch: list[tuple[OutputQueue, RequestOutput]]) -> None:
    """On the consumer's loop: a whole step's outputs into their requests' queues (one wake-up for all)."""
    for queue_, output in batch:
        queue_.put_nowait(output)


def _settle(future: asyncio.Future[int], result: int | None, error: str | None) -> None:
    if future.done():
        return
    if error is not None or result is None:
        future.set_exception(ValueError(error or "no result"))
    else:
        future.set_result(result)


StreamT = TypeVar("StreamT", bound=StreamQueue)


class StreamingEngine(Generic[StreamT]):
    """What both front doors share (AsyncEngine here, EngineProcess): each request's outputs go into its own
    asyncio queue on the consumer's loop; subclasses say how a command reaches the engine (`_send`) and what a
    request's stream holds (`_new_stream`)."""

    id_prefix = "async"

    def __init__(self) -> None:
        self._streams: dict[str, StreamT] = {}
        self._ids = itertools.count()
        self._calls: dict[int, asyncio.Future[int]] = {}
        self._call_ids = itertools.count()

    def _new_stream(self) -> StreamT:
        raise NotImplementedError

    def _send(self, command: Command) -> None:
        raise NotImplementedError

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; leaving the iteration early (or being cancelled) aborts the request.

        Raises ValueError for a bad request (before any output)."""
        request_id = request_id or f"{self.id_prefix}-{next(self._ids)}"
        stream = self._new_stream()
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt, params, priority))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def exchange(self, method: str, *args: Any) -> int:
        """One of the engine's KV exchange calls (Engine.exchange_call), run on the engine's side between steps.
        Raises ValueError when the engine refuses it."""
        call_id = next(self._call_ids)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(("call", call_id, method, args))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _answer(self, call_id: int, result: int | None, error: str | None) -> None:
        """From the engine's side: the result of an exchange call, onto the caller's loop."""
        future = self._calls.get(call_id)
        if future is not None:
            future.get_loop().call_soon_threadsafe(_settle, future, result, error)

    @staticmethod
    def _hand_over(ready: Sequence[tuple[StreamQueue, RequestOutput]]) -> None:
        """From the engine's side: a step's outputs with one wake-up per consumer loop, not one per request (each
        wake-up is a self-pipe write and a GIL hand-off that the next step would otherwise wait behind)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputQueue, RequestOutput]]] = {}
        for stream, output in ready:
            batches.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(put_all, batch)


class AsyncEngine(StreamingEngine[StreamQueue]):
    def __init__(self, config: EngineConfig | None = None, engine: Engine | None = None) -> None:
        super().__init__()
        if engine is None:
            if config is None:
                raise TypeError("AsyncEngine needs an EngineConfig or an Engine")
            # here, not at the top: EngineProcess's server side shares this module and never loads the model
            from tokenfleet.engine.engine import Engine

            engine = Engine(config)
        self.engine = engine
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="tokenfleet-engine", daemon=True)
        self._thread.start()

    @property
    def dead(self) -> str | None:
        """Why the engine can run no more steps (a tensor-parallel rank died), or None while it can."""
        return self.engine.dead

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def kv_layout(self) -> KVLayout | None:
        """What another replica's KV blocks must match to be imported here; None when blocks cannot move."""
        return self.engine.kv_exchange.layout if self.engine.kv_exchange is not None else None

    @property
    def kv_transfer_refusal(self) -> str | None:
        return self.engine.kv_transfer_refusal

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(token_ids, params)

    def state(self) -> EngineState:
        return EngineState.of(self.engine)

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    def _new_stream(self) -> StreamQueue:
        return StreamQueue(asyncio.get_running_loop(), asyncio.Queue())

    def _send(self, command: Command) -> None:
        self._inbox.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        while not self._stopped:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug, not a bad request: fail what is in flight and keep the loop alive
                log.exception("engine step crashed")
                self._fail_all(e)
                continue
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._hand_over(
            [(stream, output) for output in outputs if (stream := self._streams.get(output.request_id)) is not None]
        )

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.put(RuntimeError(f"engine step failed: {error}"))

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "abort":
                self.engine.abort(command[1])
                continue
            if command[0] == "call":
                self._answer(command[1], *run_exchange_call(self.engine, command[2], command[3]))
                continue
            _, request_id, prompt, params, priority = command
            try:
                self.engine.add_request(prompt, params, request_id=request_id, priority=priority)
            except Exception as e:  # the request is bad; the engine goes on
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.put(e if isinstance(e, ValueError) else ValueError(str(e)))


def run_exchange_call(engine: Engine, method: str, args: tuple[Any, ...]) -> tuple[int | None, str | None]:
    """(result, None), or (None, why) when the engine refused the call."""
    try:
        return engine.exchange_call(method, args), None
    except Exception as e:  # a bad chunk or a refusal: the caller's error, the engine goes on
        return None, f"{e.__class__.__name__}: {e}" if not isinstance(e, ValueError) else str(e)
