"""The recorder under a backlog of requests: at most `max_writes` outbox writes in flight (the rest wait instead of
making the database pool open a connection each), no close before its open, and a request that ended before its
open had a turn written once, by its close."""
from __future__ import annotations

import asyncio
from datetime import datetime

import pytest

from tests.metering.helpers import events
from tokenfleet.metering import UsageEvent
from tokenfleet.metering.recorder import UsageRecorder

pytestmark = pytest.mark.anyio


class SlowOutbox:
    """Writes that take a while, counting how many run at once."""

    def __init__(self) -> None:
        self.running = self.most = 0
        self.writes: list[tuple[str, str]] = []  # (open | close, request id) in the order they finished

    async def open(self, event: UsageEvent, lease_until: datetime) -> bool:
        return await self._write("open", event)

    async def close(self, event: UsageEvent) -> bool:
        return await self._write("close", event)

    async def _write(self, kind: str, event: UsageEvent) -> bool:
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0.005)
        self.running -= 1
        self.writes.append((kind, event.request_id))
        return True


async def test_at_most_max_writes_in_flight_and_no_close_before_its_open():
    outbox, requests = SlowOutbox(), events(30)
    recorder = UsageRecorder(outbox, max_writes=3)  # type: ignore[arg-type]
    for e in requests:
        recorder.started(e.request_id, lambda e=e: e)
    await asyncio.sleep(0.02)  # some opens are written, one batch is being written, the rest wait
    for e in requests:
        recorder.finished(e)
    await recorder.flush()
    assert outbox.most == 3 and not recorder.unsaved
    closed = [rid for kind, rid in outbox.writes if kind == "close"]
    assert sorted(closed) == sorted(e.request_id for e in requests)
    for kind, rid in outbox.writes:
        if kind == "open":
            assert outbox.writes.index(("open", rid)) < outbox.writes.index(("close", rid))


async def test_a_request_that_ends_before_its_open_had_a_turn_is_written_once():
    outbox, requests = SlowOutbox(), events(5)
    recorder = UsageRecorder(outbox, max_writes=1)  # type: ignore[arg-type]
    recorder.started(requests[0].request_id, lambda: requests[0])
    await asyncio.sleep(0)  # its open is writing
    for e in requests[1:]:
        recorder.started(e.request_id, lambda e=e: e)
    for e in requests:
        recorder.finished(e)
    await recorder.flush()
    first = requests[0].request_id
    assert outbox.writes[0] == ("open", first)  # the one that had its turn: opened, then closed
    assert sorted(outbox.writes[1:]) == [("close", e.request_id) for e in requests]  # no other open written


def test_max_writes_must_be_positive():
    with pytest.raises(ValueError, match="max_writes"):
        UsageRecorder(SlowOutbox(), max_writes=0)  # type: ignore[arg-type]
