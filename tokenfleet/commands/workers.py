"""`tokenfleet gateway --workers N`: N gateway processes on one port, each a whole gateway (its own event loop,
router, admission and relays) sharing Redis and PostgreSQL with the others, as gateways on several hosts do. The
kernel spreads connections over them (SO_REUSEPORT). What a gateway keeps in its own memory cannot be shared that
way, so workers need the fleet's shared stores: quotas and resume streams in Redis."""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import wait

from tokenfleet.config import FleetConfig

log = logging.getLogger(__name__)


def check_workers(config: FleetConfig, workers: int) -> None:
    """Refuses (SystemExit, one line) a worker count that the fleet file cannot support."""
    if workers < 1:
        raise SystemExit(f"tokenfleet gateway: --workers must be at least 1, got {workers}")
    if workers == 1:
        return
    missing = []
    if not config.redis_url:
        missing.append("redis_url (quotas and resume streams are otherwise kept in each process's memory)")
    elif config.quota.backend == "memory":
        missing.append("quota.backend redis (it is memory: each worker would count its own quotas)")
    if config.autoscale.enabled and config.autoscale.orchestrator == "local":
        missing.append("no local autoscaler (each worker would start its own replicas)")
    if missing:
        raise SystemExit(f"tokenfleet gateway: --workers {workers} needs " + "; ".join(missing))


def run_workers(args: argparse.Namespace, workers: int, serve: Callable[[argparse.Namespace], None]) -> None:
    """Starts `workers` processes, each running `serve(args)` as worker 0..N-1, and waits for them. A signal to
    this process goes on to every worker (SIGTERM: each drains its streams); when one worker exits, the others
    are stopped and this process exits with its status."""
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no event loop or socket carried over
    processes = [
        context.Process(target=_worker, args=(serve, _as_worker(args, index)), name=f"gateway-worker-{index}")
        for index in range(workers)
    ]
    for process in processes:
        process.start()

    def forward(signum: int, _frame: object) -> None:
        for process in processes:
            if process.is_alive() and process.pid is not None:
                _signal(process.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    first = _first_to_exit(processes)
    forward(signal.SIGTERM, None)
    for process in processes:
        process.join()
    sys.exit(first.exitcode or 0)


def _worker(serve: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> None:
    if sys.platform.startswith("linux"):  # a worker never outlives its parent, even one killed with SIGKILL
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    serve(args)


def _as_worker(args: argparse.Namespace, index: int) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "workers": 1, "worker_index": index})


def _first_to_exit(processes: list) -> multiprocessing.process.BaseProcess:
    sentinels = {process.sentinel: process for process in processes}
    ready = wait(list(sentinels))
    return sentinels[ready[0]]


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
