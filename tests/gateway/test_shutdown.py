"""The gateway's shutdown runs every closer, whatever an earlier one raises: the replicas' stop and the usage flush
come after others that talk to Redis or a database."""

from __future__ import annotations

import asyncio
import gc
import logging
from types import SimpleNamespace

from tokenfleet.gateway.app import lifespan


def test_a_failing_closer_does_not_keep_the_later_ones_from_running(caplog):
    ran: list[str] = []

    async def fails() -> None:
        ran.append("fails")
        raise ConnectionError("redis is gone")

    async def stops_replicas() -> None:
        ran.append("stops_replicas")

    async def flushes_usage() -> None:
        ran.append("flushes_usage")

    gateway = SimpleNamespace(services=[], closers=[fails, stops_replicas, flushes_usage])
    app = SimpleNamespace(state=SimpleNamespace(gateway=gateway))

    async def main() -> None:
        async with lifespan(app):
            pass

    try:
        with caplog.at_level(logging.INFO, logger="tokenfleet.gateway.app"):
            asyncio.run(main())
    finally:
        gc.unfreeze()
    assert ran == ["fails", "stops_replicas", "flushes_usage"]
    assert any("fails failed" in r.getMessage() and r.exc_info for r in caplog.records)
    assert any("3 closer(s)" in r.getMessage() for r in caplog.records)
