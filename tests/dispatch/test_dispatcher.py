"""The dispatcher's contract: grants, waiting, cancellation, release, pause, capacity changes, bad input, snapshot."""

from __future__ import annotations

import asyncio

import pytest

from tests.dispatch.sim import FakeClock, Grant, settle
from tokenfleet.config import TierConfig, default_tiers
from tokenfleet.dispatch import Dispatcher, Ticket

TIERS = default_tiers()


def ticket(n: int | str, tenant: str = "org-a", tier: str = "paid", cost: int = 100) -> Ticket:
    return Ticket(f"req-{n}", tenant, tier, cost)


def run(coro):
    return asyncio.run(coro)


def test_acquire_returns_without_waiting_when_a_slot_is_free():
    async def main():
        d = Dispatcher(TIERS, slots=2, clock=FakeClock())
        coro = d.acquire(ticket(1))
        with pytest.raises(StopIteration) as done:  # finished on its first step: it never suspended
            coro.send(None)
        slot = done.value.value
        assert slot.ticket.request_id == "req-1" and slot.waited_s == 0 and not slot.reserved
        assert d.snapshot().in_use == 1

    run(main())


def test_full_pool_queues_and_each_release_pulls_the_next_ticket_in_order():
    async def main():
        d = Dispatcher(TIERS, slots=1)
        first = await d.acquire(ticket(0))
        waiting = [asyncio.create_task(d.acquire(ticket(i))) for i in range(1, 4)]
        await settle()
        assert not any(t.done() for t in waiting) and d.snapshot().queued == 3
        order = []
        slot = first
        for task in waiting:
            d.release(slot)
            slot = await task
            order.append(slot.ticket.request_id)
            assert d.snapshot().in_use == 1
        assert order == ["req-1", "req-2", "req-3"]
        d.release(slot)
        assert d.snapshot().in_use == 0 and d.snapshot().queued == 0

    run(main())


def test_cancelling_a_waiting_ticket_removes_it_and_leaks_nothing():
    async def main():
        d = Dispatcher(TIERS, slots=1)
        held = await d.acquire(ticket(0))
        task = asyncio.create_task(d.acquire(ticket(1, cost=700)))
        await settle()
        assert d.snapshot().tiers["paid"].queued_tokens == 700
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        snap = d.snapshot()
        assert snap.queued == 0 and snap.queued_tokens == 0 and snap.tiers["paid"].cancelled == 1
        d.release(held)
        assert d.snapshot().in_use == 0  # the slot was not handed to the ghost
        again = await d.acquire(ticket(2))
        assert d.snapshot().in_use == 1 and again.ticket.request_id == "req-2"

    run(main())


def test_a_slot_granted_as_the_task_is_cancelled_is_given_back():
    async def main():
        d = Dispatcher(TIERS, slots=1)
        held = await d.acquire(ticket(0))
        task = asyncio.create_task(d.acquire(ticket(1)))
        await settle()
        d.release(held)  # grants req-1 ...
        task.cancel()  # ... but its task is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await task
        assert d.snapshot().in_use == 0 and d.snapshot().queued == 0

    run(main())


def test_a_ticket_cancelled_before_its_task_runs_is_skipped_for_the_next():
    async def main():
        d = Dispatcher(TIERS, slots=1)
        held = await d.acquire(ticket(0))
        ghost = asyncio.create_task(d.acquire(ticket(1)))
        live = asyncio.create_task(d.acquire(ticket(2)))
        await settle()
        ghost.cancel()  # its future is cancelled; the task has not run its cleanup yet
        d.release(held)
        slot = await live
        assert slot.ticket.request_id == "req-2"
        with pytest.raises(asyncio.CancelledError):
            await ghost
        snap = d.snapshot()
        assert snap.in_use == 1 and snap.queued == 0 and snap.tiers["paid"].cancelled == 1

    run(main())


def test_release_is_idempotent_and_ignores_foreign_slots():
    async def main():
        d = Dispatcher(TIERS, slots=1)
        other = Dispatcher(TIERS, slots=1)
        slot = await d.acquire(ticket(0))
        foreign = await other.acquire(ticket(9))
        waiters = [asyncio.create_task(d.acquire(ticket(i))) for i in (1, 2)]
        await settle()
        d.release(slot)
        d.release(slot)
        d.release(foreign)
        await settle()
        assert [t.done() for t in waiters] == [True, False]
        assert d.snapshot().in_use == 1 and slot.released
        with pytest.raises(ValueError, match="served_tokens"):
            d.release(waiters[0].result(), served_tokens=-1)
        waiters[1].cancel()
        await asyncio.gather(*waiters, return_exceptions=True)

    run(main())


def test_paused_tier_keeps_its_queue_and_resumes_after_unpause():
    async def main():
        d = Dispatcher(TIERS, slots=0)
        d.pause("batch")
        batch = [asyncio.create_task(d.acquire(ticket(i, "org-b", "batch"))) for i in range(3)]
        free = asyncio.create_task(d.acquire(ticket(9, "org-f", "free")))
        await settle()
        d.set_slots(4)
        await settle()
        assert free.done() and not any(t.done() for t in batch)
        snap = d.snapshot()
        assert snap.tiers["batch"].paused and snap.tiers["batch"].queued == 3 and snap.in_use == 1
        late = asyncio.create_task(d.acquire(ticket(5, "org-b", "batch")))  # a paused tier still takes tickets
        await settle()
        assert not late.done() and d.snapshot().tiers["batch"].queued == 4
        d.pause("batch", False)
        await settle()
        assert all(t.done() for t in batch) and not late.done()  # 4 slots: free + three batch
        assert d.snapshot().in_use == 4 and not d.snapshot().tiers["batch"].paused
        d.release(free.result())
        await settle()
        assert late.done()

    run(main())


def test_set_slots_grows_at_once_and_shrinking_revokes_nothing():
    async def main():
        d = Dispatcher(TIERS, slots=2)
        held = [await d.acquire(ticket(i)) for i in range(2)]
        waiting = [asyncio.create_task(d.acquire(ticket(i))) for i in range(2, 6)]
        await settle()
        d.set_slots(4)
        await settle()
        assert [t.done() for t in waiting] == [True, True, False, False]
        held += [t.result() for t in waiting[:2]]
        d.set_slots(1)
        assert d.snapshot().in_use == 4 and d.snapshot().slots == 1 and not any(s.released for s in held)
        for slot in held[:3]:
            d.release(slot)
            await settle()
            assert not waiting[2].done()  # still at or above the new size
        d.release(held[3])
        await settle()
        assert waiting[2].done() and not waiting[3].done() and d.snapshot().in_use == 1
        d.set_slots(0)
        d.release(waiting[2].result())
        await settle()
        assert not waiting[3].done() and d.snapshot().in_use == 0
        waiting[3].cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    run(main())


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="slots"):
        Dispatcher(TIERS, slots=-1)
    with pytest.raises(ValueError, match="quantum_tokens"):
        Dispatcher(TIERS, slots=1, quantum_tokens=0)
    with pytest.raises(ValueError, match="at least one tier"):
        Dispatcher({}, slots=1)
    d = Dispatcher(TIERS, slots=1)
    with pytest.raises(ValueError, match="slots"):
        d.set_slots(-2)
    with pytest.raises(ValueError, match="unknown tier 'gold'"):
        d.pause("gold")

    async def main():
        with pytest.raises(ValueError, match="unknown tier 'gold'.*enterprise"):
            await d.acquire(ticket(1, tier="gold"))
        with pytest.raises(ValueError, match="cost"):
            await d.acquire(ticket(2, cost=-5))
        with pytest.raises(ValueError, match="tenant"):
            await d.acquire(ticket(3, tenant=""))
        assert d.snapshot().queued == 0 and d.snapshot().in_use == 0

    run(main())


@pytest.mark.parametrize(
    "shares, message",
    [
        ({"a": 0.6, "b": 0.5}, "sum to 1.1"),
        ({"a": 0.0}, "in \\(0, 1\\]"),
        ({"a": 1.5}, "in \\(0, 1\\]"),
        ({"a": -0.2}, "in \\(0, 1\\]"),
    ],
)
def test_bad_provisioned_shares_raise(shares, message):
    with pytest.raises(ValueError, match=message):
        Dispatcher(TIERS, slots=1, provisioned=shares)
    Dispatcher(TIERS, slots=1, provisioned={"a": 0.5, "b": 0.5})  # the whole pool is fine


def test_snapshot_reports_queues_waits_and_counters():
    async def main():
        clock = FakeClock(100.0)
        d = Dispatcher(TIERS, slots=1, clock=clock)
        held = await d.acquire(ticket(0, cost=50))
        tasks = [asyncio.create_task(d.acquire(ticket(1, "org-f", "free", 300)))]
        await settle()
        clock.now = 102.0
        tasks.append(asyncio.create_task(d.acquire(ticket(2, "org-g", "free", 200))))
        await settle()
        clock.now = 105.0
        snap = d.snapshot()
        assert (snap.slots, snap.in_use, snap.queued, snap.queued_tokens) == (1, 1, 2, 500)
        free = snap.tiers["free"]
        assert (free.queued, free.queued_tokens, free.oldest_wait_s, free.dispatched) == (2, 500, 5.0, 0)
        assert snap.tiers["paid"].dispatched == 1 and snap.tiers["paid"].dispatched_tokens == 50
        d.release(held)
        first = await tasks[0]
        assert first.waited_s == 5.0
        clock.now = 106.0
        d.release(first)
        await tasks[1]
        free = d.snapshot().tiers["free"]
        assert (free.dispatched, free.dispatched_tokens, free.wait_s_total, free.queued) == (2, 500, 9.0, 0)

    run(main())


def test_served_tokens_reconcile_the_fair_share():
    """Two equal tiers; one's tickets are estimated at 1000 tokens but serve 100: it is charged what it used."""

    async def main():
        tiers = {"a": TierConfig(0, 1), "b": TierConfig(0, 1)}
        d = Dispatcher(tiers, slots=1)
        tasks = [asyncio.create_task(d.acquire(Ticket(f"{t}{i}", t, t, 1000))) for i in range(20) for t in "ab"]
        await settle()
        counts = {"a": 0, "b": 0}
        for _ in range(21):
            slot = next(t.result() for t in tasks if t.done() and not t.result().released)
            counts[slot.ticket.tier] += 1
            d.release(slot, served_tokens=100 if slot.ticket.tier == "a" else 1000)
            await settle()
        assert counts["a"] >= 3 * counts["b"]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    run(main())


def test_a_limit_paces_the_grants_of_its_tiers_together_over_a_window():
    clock = FakeClock()
    tiers = {"paid": TierConfig(0, 1), "batch": TierConfig(0, 1), "bulk": TierConfig(0, 1)}
    d = Dispatcher(tiers, slots=10, clock=clock)
    d.set_limit(["batch", "bulk"], 250, window_s=1.0)
    batch = [Grant() for _ in range(3)]
    for i, grant in enumerate(batch):
        d.submit(ticket(i, tier="batch"), grant)
    bulk, paid = Grant(), Grant()
    d.submit(ticket(3, tier="bulk"), bulk)
    d.submit(ticket(4, tier="paid"), paid)
    # 100 + 100 is below 250: a third goes too, then the two tiers together are at their limit; paid is not limited
    assert [g.done() for g in batch] == [True, True, True] and not bulk.done() and paid.done()
    snap = d.snapshot()
    assert snap.tiers["bulk"].at_limit and snap.tiers["batch"].at_limit and not snap.tiers["paid"].at_limit
    assert snap.queued_tokens == 100 and snap.served_queued_tokens == 0, "a queue held back is ahead of no one"
    d.release(batch[0].result())  # a pace, not a share of the pool: a finished request frees nothing
    assert not bulk.done()
    clock.now = 1.0  # the window has passed: the next call grants what is due
    d.set_limit(["batch", "bulk"], 250, window_s=1.0)
    assert bulk.done() and d.snapshot().tiers["bulk"].in_use == 1


def test_a_ticket_larger_than_its_limit_goes_alone_and_none_lifts_the_limit():
    clock = FakeClock()
    d = Dispatcher(TIERS, slots=10, clock=clock)
    d.set_limit(["batch"], 50, window_s=2.0)
    big, small = Grant(), Grant()
    d.submit(ticket(1, tier="batch", cost=500), big)
    d.submit(ticket(2, tier="batch", cost=10), small)
    assert big.done() and not small.done()
    d.set_limit(["batch"], 0, window_s=2.0)
    clock.now = 5.0
    d.set_limit(["batch"], 0, window_s=2.0)
    assert not small.done(), "a limit of 0 grants nothing"
    d.set_limit(["batch"], None)
    assert small.done() and not d.snapshot().tiers["batch"].at_limit


@pytest.mark.parametrize(
    "args, message",
    [
        ((["nope"], 10), "unknown tier"),
        ((["batch"], -1), "max_tokens"),
        ((["batch"], 1.5), "max_tokens"),
        ((["batch"], 10, 0.0), "window_s"),
    ],
)
def test_bad_limits_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        Dispatcher(TIERS, slots=1).set_limit(*args)
