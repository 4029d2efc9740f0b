"""The recorder's group commit: the opens and closes of many requests share one outbox write, one write runs at a
time, no close is written before its open, a request that ended before its open was written is written once (by its
close), and a close whose write failed is kept and written later."""

from __future__ import annotations

import asyncio
from datetime import datetime

import pytest

from tests.metering.helpers import events
from tokenfleet.metering import UsageEvent
from tokenfleet.metering.recorder import UsageRecorder

pytestmark = pytest.mark.anyio


class SlowOutbox:
    """Writes that take a while, counting how many run at once; the first `fail` writes raise."""

    def __init__(self, fail: int = 0) -> None:
        self.running = self.most = 0
        self.fail = fail
        self.batches: list[tuple[list[str], list[str]]] = []  # (opened, closed) request ids, in commit order

    async def write(self, opens: list[UsageEvent], closes: list[UsageEvent], lease_until: datetime) -> None:
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0.005)
        self.running -= 1
        if self.fail:
            self.fail -= 1
            raise ConnectionError("the database is down")
        self.batches.append(([e.request_id for e in opens], [e.request_id for e in closes]))

    def writes(self) -> list[tuple[str, str]]:
        return [
            (kind, rid)
            for opened, closed in self.batches
            for kind, rids in (("open", opened), ("close", closed))
            for rid in rids
        ]


async def test_one_write_at_a_time_many_requests_each_and_no_close_before_its_open():
    outbox, requests = SlowOutbox(), events(30)
    recorder = UsageRecorder(outbox)  # type: ignore[arg-type]
    for e in requests[:10]:
        recorder.started(e.request_id, lambda e=e: e)
    await asyncio.sleep(0.02)  # their opens are written; the next ones gather while a batch is written
    for e in requests[10:]:
        recorder.started(e.request_id, lambda e=e: e)
        await asyncio.sleep(0.0005)
    for e in requests:
        recorder.finished(e)
    await recorder.flush()
    assert outbox.most == 1 and not recorder.unsaved
    writes = outbox.writes()
    assert sorted(rid for kind, rid in writes if kind == "close") == sorted(e.request_id for e in requests)
    assert len(outbox.batches) < len(requests)  # grouped
    assert ("open", requests[0].request_id) in writes
    for kind, rid in writes:
        if kind == "open":
            assert writes.count(("open", rid)) == 1
            assert writes.index(("open", rid)) < writes.index(("close", rid))


async def test_a_request_that_ends_before_its_open_was_written_is_written_once():
    outbox, requests = SlowOutbox(), events(5)
    recorder = UsageRecorder(outbox)  # type: ignore[arg-type]
    for e in requests:
        recorder.started(e.request_id, lambda e=e: e)
    for e in requests:
        recorder.finished(e)
    await recorder.flush()
    assert outbox.batches == [([], [e.request_id for e in requests])]  # one write, no open


async def test_a_close_whose_write_failed_is_kept_and_written_later():
    outbox, requests = SlowOutbox(fail=1), events(3)
    recorder = UsageRecorder(outbox)  # type: ignore[arg-type]
    for e in requests:
        recorder.started(e.request_id, lambda e=e: e)
        recorder.finished(e)
    await asyncio.sleep(0.05)
    assert sorted(recorder.unsaved) == sorted(e.request_id for e in requests) and outbox.batches == []
    await recorder.flush()  # at shutdown, or at the next tick of `run`
    assert not recorder.unsaved and outbox.batches == [([], [e.request_id for e in requests])]


def test_batch_s_must_be_shorter_than_the_checkpoint_interval():
    with pytest.raises(ValueError, match="batch_s"):
        UsageRecorder(SlowOutbox(), checkpoint_s=1.0, batch_s=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_s"):
        UsageRecorder(SlowOutbox(), batch_s=-0.1)  # type: ignore[arg-type]


async def test_the_close_of_an_open_row_rides_along_with_the_next_batch():
    outbox, (a, b, c) = SlowOutbox(), events(3)
    recorder = UsageRecorder(outbox, batch_s=0.002, close_batch_s=0.5)  # type: ignore[arg-type]
    recorder.started(a.request_id, lambda: a)
    await asyncio.sleep(0.03)
    assert outbox.batches == [([a.request_id], [])]  # a's row is open
    recorder.finished(a)
    await asyncio.sleep(0.03)
    assert len(outbox.batches) == 1  # its close waits for company
    recorder.started(b.request_id, lambda: b)  # b's open is due in 2 ms: a's close goes with it
    recorder.started(c.request_id, lambda: c)
    recorder.finished(c)  # c's row was never opened: its close is its only write, due as soon as an open
    await asyncio.sleep(0.03)
    assert outbox.batches[1:] == [([b.request_id], [a.request_id, c.request_id])]


async def test_a_lone_close_of_an_open_row_goes_within_close_batch_s_and_at_once_on_flush():
    outbox, (a, b) = SlowOutbox(), events(2)
    recorder = UsageRecorder(outbox, batch_s=0.002, close_batch_s=0.1)  # type: ignore[arg-type]
    for e in (a, b):
        recorder.started(e.request_id, lambda e=e: e)
    await asyncio.sleep(0.03)
    recorder.finished(a)
    await asyncio.sleep(0.05)
    assert outbox.batches == [([a.request_id, b.request_id], [])]
    await asyncio.sleep(0.1)
    assert outbox.batches[1:] == [([], [a.request_id])]
    recorder.finished(b)
    await recorder.flush()  # shutdown does not wait
    assert outbox.batches[2:] == [([], [b.request_id])]


def test_close_batch_s_is_at_least_batch_s():
    with pytest.raises(ValueError, match="close_batch_s"):
        UsageRecorder(SlowOutbox(), batch_s=0.01, close_batch_s=0.005)  # type: ignore[arg-type]
