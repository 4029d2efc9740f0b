"""The local orchestrator without Redis: a replica process it starts joins the router once its /health answers,
stops on request (and leaves the router), and a replica that cannot start is reported and not retried at once."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest

from tests.autoscale.test_local import REPLICA_ARGS
from tests.gateway.inprocess import multi_model_gateway
from tokenfleet.autoscale import AutoscaleSettings, LocalSettings, PoolPolicy
from tokenfleet.autoscale import local as local_module
from tokenfleet.autoscale.local import LocalOrchestrator, LocalReplica

pytestmark = pytest.mark.anyio


async def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        await asyncio.sleep(0.2)


def orchestrator(demo_model_dir, tmp_path, args, drain_timeout_s: float = 5) -> tuple[LocalOrchestrator, object]:
    gateway = multi_model_gateway(demo_model_dir, {"tiny": []})
    settings = AutoscaleSettings(
        pools={"tiny": PoolPolicy(replica_args=tuple(args))},
        local=LocalSettings(log_dir=str(tmp_path), drain_timeout_s=drain_timeout_s, restart_backoff_s=60),
    )
    gateway.router.make_upstream = lambda url, name, kind: name  # the router only needs something to hold
    return LocalOrchestrator(gateway.router, settings), gateway.router.models["tiny"]


async def test_a_started_replica_joins_the_router_and_leaves_when_stopped(demo_model_dir, tmp_path):
    local, pools = orchestrator(demo_model_dir, tmp_path, REPLICA_ARGS)
    try:
        await local.start("tiny", "default", 1)
        (name,) = local.replicas
        assert local.starting() == {"tiny/default": 1} and name not in pools.replicas

        async def joined() -> bool:
            await local.poll()
            return name in pools.replicas

        await wait_for(joined, 90, "the replica serving")
        assert local.starting() == {} and set(local.owned()) == {name}
        assert pools.replicas[name].url == local.replicas[name].url
        proc = local.replicas[name].proc
        await local.stop(name)
        assert local.owned() == {}, "a stopping replica is no longer the autoscaler's to drain"

        async def gone() -> bool:
            await local.poll()
            return name not in local.replicas

        await wait_for(gone, 30, "the replica exiting")
        assert name not in pools.replicas and proc.returncode is not None
    finally:
        await local.close()


async def test_a_replica_that_cannot_start_is_reported_and_backed_off(demo_model_dir, tmp_path, caplog):
    local, pools = orchestrator(demo_model_dir, tmp_path, ["--no-such-flag"])
    try:
        await local.start("tiny", "default", 1)

        async def exited() -> bool:
            await local.poll()
            return not local.replicas

        await wait_for(exited, 60, "the broken replica exiting")
        assert "exited unexpectedly" in caplog.text and "--no-such-flag" in caplog.text, "with its log's tail"
        await local.start("tiny", "default", 1)
        assert local.replicas == {} and local.starting() == {}, "no restart within restart_backoff_s"
    finally:
        await local.close()


IGNORES_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up'); "
    "sys.stdout.flush(); time.sleep(60)"
)


def hung_replica(local: LocalOrchestrator, tmp_path) -> LocalReplica:
    """A serving replica of "tiny" whose process ignores SIGTERM (a drain that never ends)."""
    proc = subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE)
    proc.stdout.readline()  # its SIGTERM handler is set
    proc.stdout.close()
    replica = LocalReplica(
        "127.0.0.1:9",
        "tiny",
        "default",
        "http://127.0.0.1:9",
        proc,
        tmp_path / "hung.log",
        time.time(),
        time.monotonic(),
        ready=True,
    )
    local.replicas[replica.name] = replica
    return replica


async def test_a_stopped_replica_that_hangs_is_killed_after_the_drain_limit(
    demo_model_dir, tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(local_module, "KILL_SLACK_S", 0.5, raising=False)
    local, _ = orchestrator(demo_model_dir, tmp_path, [], drain_timeout_s=0.2)
    replica = hung_replica(local, tmp_path)
    try:
        await local.stop(replica.name)
        stopped = time.monotonic()
        await local.poll()
        assert replica.proc.poll() is None and replica.name in local.replicas, "within the drain limit: left be"

        async def gone() -> bool:
            await local.poll()
            return replica.name not in local.replicas

        await wait_for(gone, 5, "the hung replica killed and reaped")
        assert time.monotonic() - stopped >= 0.2 + 0.5, "not before drain_timeout_s + the slack"
        assert replica.proc.returncode == -signal.SIGKILL
        assert "still running" in caplog.text and "killing it" in caplog.text
    finally:
        replica.proc.kill()
        replica.proc.wait()
        await local.close()


async def test_a_stopping_replica_holds_its_machine_until_its_process_exits(demo_model_dir, tmp_path):
    local, _ = orchestrator(demo_model_dir, tmp_path, [], drain_timeout_s=60)
    replica = hung_replica(local, tmp_path)
    try:
        assert local.stopping() == {} and set(local.owned()) == {replica.name}
        await local.stop(replica.name)
        await local.poll()
        assert local.stopping() == {"tiny/default": 1} and local.owned() == {} and local.starting() == {}
        replica.proc.kill()
        replica.proc.wait()
        assert local.stopping() == {}, "exited: its machine is free"
    finally:
        replica.proc.kill()
        replica.proc.wait()
        await local.close()
