"""The metering loops stop when cancelled (as the gateway does at shutdown, then awaits them) even when a client
library loses the cancellation and returns normally, as redis-py's XREADGROUP BLOCK does now and then when the
cancel meets its reply: before, the loop went on and the gateway's shutdown waited forever."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from tests.metering.helpers import event
from tokenfleet.metering import MemoryLog, Outbox, OutboxShipper, UsageEvent, WarehouseWriter
from tokenfleet.metering.log import Entry
from tokenfleet.store.db import Database

pytestmark = pytest.mark.anyio


class LosesCancellation(MemoryLog):
    """A log whose first call cancelled while it waits returns as if nothing happened."""

    lost = False

    async def read(self, consumer: str, count: int = 100, block_ms: int = 1000) -> list[Entry]:
        try:
            return await super().read(consumer, count, block_ms)
        except asyncio.CancelledError:
            return self._lose([])

    async def publish(self, events: Sequence[UsageEvent]) -> list[str]:
        try:
            await asyncio.sleep(10)  # a slow publish, cancelled meanwhile
        except asyncio.CancelledError:
            self._lose(None)
        return await super().publish(events)

    def _lose(self, result):
        if self.lost:
            raise asyncio.CancelledError()
        self.lost = True
        return result


async def stops_when_cancelled(loop: asyncio.Task) -> None:
    await asyncio.sleep(0.1)  # the loop is waiting in the log now
    loop.cancel()
    done, _ = await asyncio.wait({loop}, timeout=5)  # not wait_for: it would wait for a loop that never ends
    if not done:
        loop.cancel()  # a second cancellation is not lost: the test fails instead of hanging
        await asyncio.wait({loop}, timeout=5)
    assert done and loop.cancelled(), "the loop went on after it was cancelled"


async def test_the_warehouse_writer_stops_when_a_read_loses_the_cancellation(db: Database):
    writer = WarehouseWriter(db, LosesCancellation(), "writer-1", block_ms=1000)
    await stops_when_cancelled(asyncio.create_task(writer.run()))


async def test_the_shipper_stops_when_a_publish_loses_the_cancellation(outbox: Outbox):
    await outbox.add(event(1))
    shipper = OutboxShipper(outbox, LosesCancellation(), interval_s=0.05)
    await stops_when_cancelled(asyncio.create_task(shipper.run()))
    assert shipper.shipped == 1  # the publish went through; the loop stopped after it
