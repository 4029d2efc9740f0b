"""Tensor parallelism, rank 0's side: the engine's own process is rank 0 and starts one worker process per other
rank (engine/tp_worker.py). The scheduler, block manager and sampler run here only; each step this process sends
the step's prepared model inputs (and its swap copies) to every worker, and all ranks run their shard of the
forward pass together (model/parallel.py), with a process group of their own: gloo on CPU, NCCL on CUDA, met
through a TCP store on a free local port.

A rank that dies or hangs takes the group down for good: a watcher thread notices a worker's exit at once, every
step first checks that all ranks are alive, and collectives time out (COLLECTIVE_TIMEOUT_S) instead of waiting
forever. The step then fails its requests with the reason and `lost` says why the engine can step no more.
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store, TCPStore  # torch.distributed re-exports them untyped

from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.runner import ModelRunner
from tokenfleet.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenfleet.engine.step_inputs import StepInputs
from tokenfleet.model.attention import AttentionMetadata, DecodeGroup, PrefillBatch, PrefillChunk
from tokenfleet.model.config import ModelConfig
from tokenfleet.model.llama import LlamaForCausalLM
from tokenfleet.model.loader import load_model
from tokenfleet.model.parallel import TensorShard, check_divisible

log = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT_S = 60.0  # a rank that hangs this long inside a step takes the group down
START_TIMEOUT_S = 900.0  # a worker that has not loaded its shard by then fails the start
RENDEZVOUS_TIMEOUT_S = 60.0  # the ranks meet through the TCP store within this (they are all started by then)
STOP_TIMEOUT_S = 5.0
EXIT_SHOWS_S = 1.0  # how long a failed step waits for a dead rank's exit to name it as the reason
POLL_S = 0.2
_REPO_ROOT = Path(__file__).resolve().parents[2]  # where `python -m tokenfleet.engine.tp_worker` imports from


class TensorParallelLost(RuntimeError):
    """A rank is gone (or a step failed part-way on some ranks): the group can run no more steps."""


# --- what crosses the pipes ----------------------------------------------------------------------------------


@dataclass
class WorkerSpec:
    config: EngineConfig
    rank: int
    world_size: int
    store_port: int
    device: str
    dtype: torch.dtype | None
    max_positions: int
    threads: int


@dataclass
class CacheSpec:
    """The paged KV cache every rank allocates: the same blocks as rank 0's, of the rank's own heads."""

    num_blocks: int
    num_host_blocks: int
    kv_dtype: torch.dtype


@dataclass
class ForwardInputs:
    """A step's model inputs as the runner built them, without the requests they belong to."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    uses_kernel: bool  # decode groups without a mask go through the fused CPU kernel

    @classmethod
    def of(cls, inputs: StepInputs, uses_kernel: bool) -> ForwardInputs:
        return cls(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices, uses_kernel)

    def to(self, device: torch.device) -> ForwardInputs:
        if self.input_ids.device == device:
            return self
        return ForwardInputs(
            self.input_ids.to(device),
            self.positions.to(device),
            meta_to(self.meta, device),
            self.logits_indices.to(device),
            self.uses_kernel,
        )


@dataclass
class StepMessage:
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    forward: ForwardInputs | None


def meta_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    batch = meta.prefill_batch

    return AttentionMetadata(
        meta.slot_blocks.to(device),
        meta.slot_offsets.to(device),
        meta.block_size,
        [
            DecodeGroup(g.start, g.block_tables.to(device), g.context_lens.to(device), move(g.mask))
            for g in meta.decodes
        ],
        [
            PrefillChunk(
                c.query_start,
                c.query_len,
                None if c.context is None else (c.context[0].to(device), c.context[1].to(device)),
                move(c.mask),
            )
            for c in meta.prefills
        ],
        None
        if batch is None
        else PrefillBatch(
            batch.row_start, batch.block_tables.to(device), batch.query_lens.to(device), batch.context_starts.to(device)
        ),
    )


def dumps(message: object) -> bytes:
    """Pickled with tensors as raw bytes: ten times faster than torch's own reduction (a torch.save per tensor),
    and multiprocessing's pickler would move them through shared memory instead."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}
    pickler.dump(message)
    return buffer.getvalue()


def _reduce_tensor(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return _rebuild_tensor, (flat.numpy().tobytes(), tensor.dtype, tuple(tensor.shape))


def _rebuild_tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def send(conn: Connection, message: object) -> None:
    conn.send_bytes(dumps(message))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


# --- the process group ----------------------------------------------------------------------------------------


class ProcessGroupCollectives:
    """model/parallel.py's Collectives over a process group object of our own (not torch.distributed's global
    default group, so that engines come and go in one process)."""

    def __init__(self, store: Store, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size = rank, world_size
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        self.pg: Any
        if device.type == "cuda":  # untested here: no GPU in CI
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.pg.allreduce([tensor]).wait()

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank != 0:
            self.pg.gather([], [tensor], options).wait()
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.pg.gather([parts], [tensor], options).wait()
        return parts


def check_tensor_parallel(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> None:
    """Raises ValueError naming what stops this model from being split tensor_parallel_size ways here."""
    size = config.tensor_parallel_size
    check_divisible(model_config, size)
    unsupported = {
        "speculative_config": config.speculative_config is not None,
        "quantization": config.quantization is not None or model_config.quantization is not None,
        f"kv_cache_dtype {config.kv_cache_dtype}": config.kv_cache_dtype != "auto",
    }
    for what, used in unsupported.items():
        if used:
            raise ValueError(f"{what} is not supported with tensor_parallel_size {size} yet; use one or the other")
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"tensor_parallel_size {size} needs {size} GPUs (one per rank); this machine has "
            f"{torch.cuda.device_count()}"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor parallelism runs on cpu or cuda, not {device.type}")


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen[bytes]
    conn: Connection


class TensorParallelGroup:
    """Rank 0's handle on the group: the worker processes, their pipes, the collectives, and whether it is lost."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        dtype: torch.dtype | None,
        device: torch.device,
        max_positions: int,
    ) -> None:
        check_tensor_parallel(config, model_config, device)
        self.size = config.tensor_parallel_size
        self.lost: str | None = None  # why the group can run no more steps
        # called once, from whichever thread noticed, when the group is lost: e.g. an engine process exits, so
        # that its server reports the engine down at once, even while idle
        self.on_lost: Callable[[str], None] | None = None
        self._closing = threading.Event()
        store = TCPStore(
            "127.0.0.1", 0, self.size, True, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S), wait_for_workers=False
        )
        threads = self._threads_per_rank(config, device)
        self.workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers, self._closing)
        try:
            for rank in range(1, self.size):
                device_name = f"cuda:{rank}" if device.type == "cuda" else "cpu"
                spec = WorkerSpec(config, rank, self.size, store.port, device_name, dtype, max_positions, threads)
                self.workers.append(_spawn(spec))
            self._expect("started")
            self.collectives = ProcessGroupCollectives(store, 0, self.size, device)
            self.model: LlamaForCausalLM = load_model(
                config.model,
                dtype,
                device,
                max_positions=max_positions,
                shard=(TensorShard(0, self.size), self.collectives),
            )
            self._expect("loaded")
        except BaseException:
            self.close()
            raise
        for worker in self.workers:
            threading.Thread(
                target=_watch, args=(weakref.ref(self), worker), name=f"tokenfleet-tp-watch-{worker.rank}", daemon=True
            ).start()
        log.info(
            "tensor parallel: rank 0 of %d (%s), workers' pids %s, %d PyTorch thread(s) per rank",
            self.size,
            "NCCL" if device.type == "cuda" else "gloo",
            self.worker_pids,
            threads,
        )

    def _threads_per_rank(self, config: EngineConfig, device: torch.device) -> int:
        """config.threads for every rank when set; else on CPU the ranks share this process's threads (they share
        its cores), rank 0 included."""
        if config.threads or device.type != "cpu":
            return config.threads or torch.get_num_threads()
        threads = max(1, torch.get_num_threads() // self.size)
        torch.set_num_threads(threads)
        return threads

    def runner(self, config: EngineConfig, device: torch.device) -> TensorParallelRunner:
        """Rank 0's runner; the workers allocate the same cache blocks for their heads before it returns."""
        try:
            runner = TensorParallelRunner(self.model, config, device, self)
            self._broadcast(CacheSpec(runner.num_blocks, runner.num_host_blocks, runner.kv_dtype))
            self._expect("ready")
        except BaseException:
            self.close()
            raise
        return runner

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    def check_alive(self) -> None:
        """Raises TensorParallelLost if any rank is gone (checked before each step)."""
        for worker in self.workers:
            code = worker.process.poll()
            if code is not None and self.lost is None:
                self.lose(f"tensor-parallel rank {worker.rank} (pid {worker.process.pid}) exited with code {code}")
        if self.lost is not None:
            raise TensorParallelLost(self.lost)

    def why_failed(self, error: Exception) -> str:
        """A failed step's reason: a rank that exited (a collective with a dead peer fails before the exit shows,
        so give it a moment), else the error itself."""
        deadline = time.monotonic() + EXIT_SHOWS_S
        while self.lost is None:
            exited = [w for w in self.workers if w.process.poll() is not None]
            if exited:
                worker = exited[0]
                return f"tensor-parallel rank {worker.rank} (pid {worker.process.pid}) exited with code {worker.process.returncode}"
            if time.monotonic() > deadline:
                return f"a tensor-parallel step failed: {error}"
            time.sleep(0.02)
        return self.lost

    def send_step(self, message: StepMessage) -> None:
        self._broadcast(message)

    def lose(self, reason: str) -> None:
        """Marks the group dead (the first reason stays) and kills the other ranks: they can do nothing useful
        now, and one may be stuck in a collective."""
        first = self.lost is None
        if first:
            self.lost = reason
            log.error("%s: this engine can run no more steps", reason)
        self._closing.set()
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.kill()
        self.close()
        if first and self.on_lost is not None:
            self.on_lost(reason)

    def close(self) -> None:
        self._finalizer()

    def _broadcast(self, message: object) -> None:
        data = dumps(message)
        for worker in self.workers:
            try:
                worker.conn.send_bytes(data)
            except (OSError, ValueError) as e:
                self.lose(f"tensor-parallel rank {worker.rank} is unreachable: {e}")
                raise TensorParallelLost(self.lost or str(e)) from e

    def _expect(self, kind: str) -> None:
        """Waits for every worker's `kind` message, failing fast on one that reports a failure or exits."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for worker in self.workers:
            while not worker.conn.poll(POLL_S):
                code = worker.process.poll()
                if code is not None:
                    raise RuntimeError(f"tensor-parallel rank {worker.rank} exited while starting (exit code {code})")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tensor-parallel rank {worker.rank} did not start within {START_TIMEOUT_S:.0f} s"
                    )
            got = receive(worker.conn)
            if got[0] == "failed":
                raise RuntimeError(f"tensor-parallel rank {worker.rank} failed to start: {got[1]}")
            if got[0] != kind:
                raise RuntimeError(f"tensor-parallel rank {worker.rank} said {got[0]!r}, expected {kind!r}")


def _spawn(spec: WorkerSpec) -> _Worker:
    """`python -m tokenfleet.engine.tp_worker FD`, FD its end of a socket pair (a subprocess, not
    multiprocessing: the engine process that starts it is a daemon, which multiprocessing forbids children)."""
    ours, theirs = socket.socketpair()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH")) if p)
    with theirs:
        process = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet.engine.tp_worker", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
        )
    conn = Connection(ours.detach())
    send(conn, spec)
    return _Worker(spec.rank, process, conn)


def _watch(group_ref: weakref.ref[TensorParallelGroup], worker: _Worker) -> None:
    """Notices a worker's exit at once, not only at the next step."""
    code = worker.process.wait()
    group = group_ref()
    if group is not None and not group._closing.is_set():
        group.lose(f"tensor-parallel rank {worker.rank} (pid {worker.process.pid}) exited with code {code}")


def _stop_workers(workers: list[_Worker], closing: threading.Event) -> None:
    """Closing the pipes ends an idle worker; one stuck in a collective is killed after STOP_TIMEOUT_S."""
    closing.set()
    for worker in workers:
        worker.conn.close()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for worker in workers:
        try:
            worker.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()


# --- rank 0's runner ------------------------------------------------------------------------------------------


class TensorParallelRunner(ModelRunner):
    """ModelRunner whose step first sends its swap copies and inputs to the other ranks. Any failure in a step
    loses the group: the ranks may have run different parts of it and their caches can no longer be trusted."""

    def __init__(
        self, model: LlamaForCausalLM, config: EngineConfig, device: torch.device, group: TensorParallelGroup
    ) -> None:
        self.group = group
        self._pending: StepMessage | None = None  # this step's swaps, until its inputs go out with them
        super().__init__(model, config, device)

    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, list[ScheduledChunk]]:
        self.group.check_alive()
        self._pending = StepMessage(out.swap_out, out.swap_in, None)
        try:
            result = super().execute(out)
            if self._pending is not None and (out.swap_out or out.swap_in):  # a step of swaps alone
                self.group.send_step(self._pending)
        except TensorParallelLost:
            raise
        except Exception as e:
            self.group.lose(self.group.why_failed(e))
            raise TensorParallelLost(self.group.lost or str(e)) from e
        finally:
            self._pending = None
        return result

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        inputs = super().prepare(chunks)
        swaps = self._pending or StepMessage([], [], None)
        forward = ForwardInputs.of(inputs, uses_kernel=self.decode_kernel is not None).to(torch.device("cpu"))
        self.group.send_step(dataclasses.replace(swaps, forward=forward))
        self._pending = None
        return inputs
