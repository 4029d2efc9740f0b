"""A tensor-parallel worker rank (rank >= 1): `python -m tokenfleet.engine.tp_worker FD`, started by rank 0
(engine/tensor_parallel.py) with FD its end of a socket pair.

It loads only its shard of the weights, allocates its share of the paged KV cache (rank 0's blocks, its own
heads), then runs each step rank 0 sends: the swap copies, then its shard of the forward pass, whose collectives
meet rank 0's. It ends when the pipe closes (rank 0 stopped or died) or a step fails (a collective timed out, a
peer died): rank 0 sees the exit and takes the group down.
"""

from __future__ import annotations

import logging
import signal
import sys
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

from tokenfleet.engine.runner import copy_blocks, device_cache, host_cache
from tokenfleet.engine.tensor_parallel import (
    RENDEZVOUS_TIMEOUT_S,
    CacheSpec,
    ProcessGroupCollectives,
    StepMessage,
    WorkerSpec,
    receive,
    send,
)
from tokenfleet.model.attention import PagedAttention
from tokenfleet.model.cpu_kernels import paged_decode_attention_op
from tokenfleet.model.loader import load_model
from tokenfleet.model.parallel import TensorShard

log = logging.getLogger(__name__)


class ShardWorker:
    def __init__(self, spec: WorkerSpec, conn: Connection) -> None:
        self.conn, self.rank = conn, spec.rank
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        config = spec.config
        store = TCPStore(
            "127.0.0.1", spec.store_port, spec.world_size, False, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        )
        self.collectives = ProcessGroupCollectives(store, spec.rank, spec.world_size, self.device)
        self.model = load_model(
            config.model,
            spec.dtype,
            self.device,
            max_positions=spec.max_positions,
            shard=(TensorShard(spec.rank, spec.world_size), self.collectives),
        )
        send(conn, ("loaded",))
        cache: CacheSpec = receive(conn)
        cfg = self.model.config  # the shard's: its KV heads
        self.block_shape = (cfg.num_layers, 2, cfg.num_kv_heads, config.block_size * cfg.head_dim)
        self.kv_dtype, self.num_host_blocks = cache.kv_dtype, cache.num_host_blocks
        self.kv_cache = device_cache(self.block_shape, cache.num_blocks, cache.kv_dtype, self.device)
        self._host_cache: torch.Tensor | None = None
        self.uses_kernel = False
        self.attention = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        send(conn, ("ready",))

    @property
    def host_cache(self) -> torch.Tensor:
        if self._host_cache is None:
            self._host_cache = host_cache(self.block_shape, self.num_host_blocks, self.kv_dtype, self.device)
        return self._host_cache

    def run(self) -> int:
        while True:
            try:
                message: StepMessage | None = receive(self.conn)
            except (EOFError, OSError):
                return 0  # rank 0 closed the pipe: stopped, or gone
            if message is None:
                return 0
            self.step(message)

    def step(self, message: StepMessage) -> None:
        if message.swap_out:
            copy_blocks(self.kv_cache, self.host_cache, message.swap_out)
        if message.swap_in:
            copy_blocks(self.host_cache, self.kv_cache, message.swap_in)
        if message.forward is None:
            return
        inputs = message.forward.to(self.device)
        self._use_kernel(inputs.uses_kernel)
        self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, inputs.logits_indices)

    def _use_kernel(self, uses_kernel: bool) -> None:
        """Decodes the way rank 0 does: its inputs for the kernel have no padding masks."""
        if uses_kernel == self.uses_kernel:
            return
        op = paged_decode_attention_op() if uses_kernel else None
        if uses_kernel and op is None:
            raise RuntimeError("rank 0 decodes with the CPU kernel, which this rank cannot load")
        for attention in self.attention:
            attention.decode_kernel = op
        self.uses_kernel = uses_kernel


def main(argv: list[str]) -> int:
    from tokenfleet.logs import configure_logging

    # like the engine process that started it: a Ctrl-C goes to the server, which drains; this rank ends with the pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    spec: WorkerSpec = receive(conn)
    configure_logging()
    torch.set_num_threads(spec.threads)
    send(conn, ("started",))
    try:
        worker = ShardWorker(spec, conn)
    except Exception as e:
        log.exception("tensor-parallel rank %d failed to start", spec.rank)
        try:
            send(conn, ("failed", f"{e.__class__.__name__}: {e}"))
        except OSError:
            pass
        return 1
    try:
        return worker.run()
    except Exception:
        log.exception("tensor-parallel rank %d: a step failed; this rank stops", spec.rank)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
