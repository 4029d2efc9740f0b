"""EngineProcess: the engine steps in a process of its own; the server's process keeps the HTTP loop.

On a thread of the server's process, every PyTorch call of a step has to win the GIL back from the event loop,
which is busy turning the previous step's tokens into SSE events: served steps took 2-3x their offline time. In
its own process the engine never waits on the loop. Same interface as AsyncEngine (generate, abort, validate,
state, tokenizer, max_model_len, shutdown), so the replica server and `tokenfleet serve` take either.

The pipe carries commands one way and, per step, the step's new tokens (not the whole request) plus an
EngineState snapshot the other way; a reader thread here rebuilds each request's RequestOutput and hands a step's
outputs to the event loop with one wake-up.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenfleet.engine.async_engine import Command, StreamingEngine, StreamQueue, run_exchange_call
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.kv_transfer import KVChunk, KVLayout
from tokenfleet.engine.limits import EngineLimits
from tokenfleet.engine.outputs import RequestOutput, RequestTiming
from tokenfleet.engine.request import SamplingParams, TokenLogprob
from tokenfleet.engine.state import EngineState
from tokenfleet.engine.structured import GrammarCompiler

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from tokenfleet.engine.async_engine import AsyncEngine
    from tokenfleet.engine.engine import Engine

log = logging.getLogger(__name__)
STATE_INTERVAL_S = 0.02


def server_threads(config: EngineConfig) -> int:
    """PyTorch threads for an engine beside an HTTP server: `threads`, or every usable core but one (the event
    loop's; two threads contending for one core cost more than the second thread gains)."""
    if config.threads > 0:
        return config.threads
    return max(1, len(os.sched_getaffinity(0)) - 1)


@dataclass
class _Delta:
    """What one step added to one request (the pipe never carries a request's whole history)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_cached_tokens: int
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None
    new_logprobs: list[TokenLogprob]
    engine_s: float
    prompt_token_ids: list[int] | None  # on a request's first output only
    timing: RequestTiming | None
    kv_chunk: KVChunk | None


@dataclass
class _Stream(StreamQueue):
    """A request's queue, plus what its outputs so far add up to (the pipe carries only what is new)."""

    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def output(self, d: _Delta) -> RequestOutput:
        if d.prompt_token_ids is not None:
            self.prompt_token_ids = d.prompt_token_ids
        self.token_ids += d.new_token_ids
        self.text += d.new_text
        self.logprobs += d.new_logprobs
        # the growing lists themselves, as the in-process engine hands out (a copy per token would be quadratic)
        return RequestOutput(
            d.request_id,
            self.prompt_token_ids,
            self.token_ids,
            self.text,
            d.new_token_ids,
            d.new_text,
            d.num_cached_tokens,
            d.finished,
            d.finish_reason,
            d.stop_reason,
            d.error,
            self.logprobs,
            d.new_logprobs,
            d.engine_s,
            d.timing,
            d.kv_chunk,
        )


class EngineProcess(StreamingEngine[_Stream]):
    id_prefix = "proc"

    def __init__(self, config: EngineConfig, start_timeout_s: float = 600.0) -> None:
        from tokenfleet.model.tokenizer import Tokenizer

        super().__init__()
        self.tokenizer = None if config.skip_tokenizer_init else Tokenizer.from_dir(config.model)
        context = multiprocessing.get_context("spawn")  # fork would copy a process with threads running
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_engine_main, args=(config, child, server_threads(config)), name="tokenfleet-engine", daemon=True
        )
        self._process.start()
        child.close()
        self.limits, self._state, self.kv_layout, self.kv_transfer_refusal = self._wait_ready(start_timeout_s)
        # the same compile as in the engine process, so that what only the tokenizer can refuse is refused here,
        # before a response starts; compiled once per spec, like there
        eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer is not None else set()
        self.grammars = GrammarCompiler(self.tokenizer, self.limits.vocab_size, eos_token_ids)
        self._send_lock = threading.Lock()
        self.dead: str | None = None  # why the engine process is gone, once it is
        self._reader = threading.Thread(target=self._read, name="tokenfleet-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float) -> tuple[EngineLimits, EngineState, KVLayout | None, str | None]:
        if not self._conn.poll(timeout_s):
            self._process.kill()
            raise RuntimeError(f"the engine process did not start within {timeout_s:.0f} s")
        try:
            kind, *payload = self._conn.recv()
        except EOFError:
            raise RuntimeError(
                f"the engine process exited while starting (exit code {self._process.exitcode})"
            ) from None
        if kind == "failed":
            raise RuntimeError(f"the engine failed to start: {payload[0]}")
        return payload[0], payload[1], payload[2], payload[3]

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self.limits.validate(token_ids, params)
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)

    def state(self) -> EngineState:
        return self._state

    def _new_stream(self) -> _Stream:
        if self.dead:
            raise RuntimeError(f"the engine process is gone: {self.dead}")
        return _Stream(asyncio.get_running_loop(), asyncio.Queue())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._send(("stop",))
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    def _send(self, command: Command) -> None:
        if self.dead:
            return
        try:
            with self._send_lock:
                self._conn.send(command)
        except (OSError, ValueError) as e:  # the engine process is gone; the reader fails the streams
            log.warning("engine process unreachable: %s", e)

    # --- the reader thread --------------------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                kind, *payload = self._conn.recv()
            except (EOFError, OSError):
                self._engine_gone()
                return
            if kind == "step":
                self._state = payload[1] or self._state
                self._deliver(payload[0])
            elif kind == "state":
                self._state = payload[0]
            elif kind == "answer":
                self._answer(*payload)
            elif kind == "rejected":
                self._put(payload[0], ValueError(payload[1]))
            elif kind == "crashed":
                for request_id in payload[0]:
                    self._put(request_id, RuntimeError(f"engine step failed: {payload[1]}"))

    def _deliver(self, deltas: list[_Delta]) -> None:
        self._hand_over(
            [
                (stream, stream.output(delta))
                for delta in deltas
                if (stream := self._streams.get(delta.request_id)) is not None
            ]
        )

    def _put(self, request_id: str, item: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)

    def _engine_gone(self) -> None:
        self._process.join(1.0)
        self.dead = f"exit code {self._process.exitcode}"
        if self._streams:
            log.error("the engine process exited (%s); failing %d request(s)", self.dead, len(self._streams))
        for request_id in list(self._streams):
            self._put(request_id, RuntimeError(f"the engine process exited ({self.dead})"))
        for call_id in list(self._calls):
            self._answer(call_id, None, f"the engine process exited ({self.dead})")


# --- the engine process ---------------------------------------------------------------------------------------


def _engine_main(config: EngineConfig, conn: Connection, threads: int) -> None:
    """Loads the model, then steps while there is work and waits on the pipe when there is none. Signals go to
    the server process, which drains first; this process ends when told to, or when the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    from tokenfleet.engine.engine import Engine
    from tokenfleet.logs import configure_logging
    from tokenfleet.model.cpu_kernels import build_in_background

    configure_logging()
    torch.set_num_threads(threads)
    build_in_background()  # a server answers on the PyTorch path rather than wait for a compiler
    try:
        engine = Engine(config)
    except Exception as e:  # a bad checkpoint or config: the server reports it and exits
        conn.send(("failed", f"{e.__class__.__name__}: {e}"))
        return
    if engine.tensor_parallel is not None:  # a rank that dies takes this process down: the server reports it down
        engine.tensor_parallel.on_lost = lambda reason: os._exit(3)
    # The model, its modules and the imported code live as long as the process: out of the collector's sight, a full
    # collection no longer walks them (one took ~57 ms mid-burst at 32 req/s, stalling every request in the step).
    gc.collect()
    gc.freeze()
    log.info("engine process %d: %d PyTorch thread(s)", os.getpid(), threads)
    layout = engine.kv_exchange.layout if engine.kv_exchange is not None else None
    conn.send(("ready", engine.limits, EngineState.of(engine), layout, engine.kv_transfer_refusal))
    _EngineLoop(engine, conn).run()


class _EngineLoop:
    def __init__(self, engine: Engine, conn: Connection) -> None:
        self.engine, self.conn = engine, conn
        self.started: set[str] = set()  # requests whose prompt token ids went over already
        self.state_sent_at = 0.0
        self.reported_idle = True  # the last snapshot sent showed no work

    def run(self) -> None:
        try:
            while self._apply_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
        except (EOFError, OSError):
            pass  # the server process is gone

    def _apply_commands(self, block: bool) -> bool:
        """Applies every waiting command (waiting for one when idle); False once told to stop. A step sends the
        state after it; commands that leave nothing to step (the last request aborted) send it themselves."""
        applied = False
        while block or self.conn.poll():
            block, applied = False, True
            command = self.conn.recv()
            if command[0] == "stop":
                return False
            if command[0] == "abort":
                self.engine.abort(command[1])
                self.started.discard(command[1])
            elif command[0] == "call":
                self.conn.send(("answer", command[1], *run_exchange_call(self.engine, command[2], command[3])))
            else:
                self._add(*command[1:])
        if applied and not self.engine.has_unfinished():
            self.conn.send(("state", self._snapshot()))
        return True

    def _add(self, request_id: str, prompt: str | list[int], params: SamplingParams | None, priority: int) -> None:
        try:
            self.engine.add_request(prompt, params, request_id=request_id, priority=priority)
        except Exception as e:  # the request is bad; the engine goes on
            self.conn.send(("rejected", request_id, str(e)))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug, not a bad request: fail what is in flight and keep going
            log.exception("engine step crashed")
            ids = list(self.engine.tracked)
            for request_id in ids:
                self.engine.abort(request_id)
            self.conn.send(("crashed", ids, str(e)))
            return
        self.conn.send(("step", [self._delta(o) for o in outputs], self._state_if_due()))

    def _state_if_due(self) -> EngineState | None:
        """A snapshot at most every STATE_INTERVAL_S while busy (the router polls load every 100 ms or more), and
        always on a change between idle and busy, so that neither an idle nor a newly busy engine reports stale
        load."""
        busy = self.engine.has_unfinished()
        if busy and not self.reported_idle and time.monotonic() - self.state_sent_at < STATE_INTERVAL_S:
            return None
        return self._snapshot()

    def _snapshot(self) -> EngineState:
        self.state_sent_at, self.reported_idle = time.monotonic(), not self.engine.has_unfinished()
        return EngineState.of(self.engine)

    def _delta(self, out: RequestOutput) -> _Delta:
        first = out.request_id not in self.started
        if out.finished:
            self.started.discard(out.request_id)
        elif first:
            self.started.add(out.request_id)
        return _Delta(
            out.request_id,
            out.new_token_ids,
            out.new_text,
            out.num_cached_tokens,
            out.finished,
            out.finish_reason,
            out.stop_reason,
            out.error,
            out.new_logprobs,
            out.engine_s,
            out.prompt_token_ids if first else None,
            out.timing,
            out.kv_chunk,
        )


def start_engine(config: EngineConfig) -> EngineProcess | AsyncEngine:
    """The engine a server runs: in its own process (the default), or on a thread of this one."""
    if config.engine_process:
        return EngineProcess(config)
    import torch

    from tokenfleet.engine.async_engine import AsyncEngine
    from tokenfleet.model.cpu_kernels import build_in_background

    torch.set_num_threads(server_threads(config))
    build_in_background()
    return AsyncEngine(config)
