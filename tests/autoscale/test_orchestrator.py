"""The local orchestrator without Redis: a replica process it starts joins the router once its /health answers,
stops on request (and leaves the router), and a replica that cannot start is reported and not retried at once."""
from __future__ import annotations

import asyncio
import time

import pytest

from tests.autoscale.test_local import REPLICA_ARGS
from tests.gateway.inprocess import multi_model_gateway
from tokenfleet.autoscale import AutoscaleSettings, LocalSettings, PoolPolicy
from tokenfleet.autoscale.local import LocalOrchestrator

pytestmark = pytest.mark.anyio


async def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        await asyncio.sleep(0.2)


def orchestrator(demo_model_dir, tmp_path, args) -> tuple[LocalOrchestrator, object]:
    gateway = multi_model_gateway(demo_model_dir, {"tiny": []})
    settings = AutoscaleSettings(pools={"tiny": PoolPolicy(replica_args=tuple(args))},
                                 local=LocalSettings(log_dir=str(tmp_path), drain_timeout_s=5, restart_backoff_s=60))
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
