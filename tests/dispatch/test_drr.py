"""Deficit round-robin across tenants, on its own."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from tokenfleet.dispatch.drr import TenantRoundRobin


@dataclass(eq=False)
class Item:
    name: str
    tenant: str
    cost: int
    enqueued_at: float = 0.0


def drain(queue: TenantRoundRobin, pops: int | None = None) -> list[str]:
    names = []
    while pops is None or len(names) < pops:
        item = queue.pop()
        if item is None:
            break
        names.append(item.name)
    return names


def test_sparse_tenant_goes_next_but_only_once_per_round():
    q = TenantRoundRobin(quantum=1000)
    for i in range(1, 11):
        q.push(Item(f"A{i}", "A", 500))
    order = drain(q, 3)
    q.push(Item("B1", "B", 100))  # B had nothing queued: it goes before the rest of A's turn
    order += drain(q, 1)
    q.push(Item("B2", "B", 100))  # still in its first turn, with quantum left
    order += drain(q, 2)  # B's turn ended when it emptied: it is now at the end of the round
    q.push(Item("B3", "B", 100))  # so this one waits for A's turn to end
    order += drain(q, 2)
    q.push(Item("B4", "B", 100))  # B left the round when it was found empty: new again
    order += drain(q, 1)
    assert order == ["A1", "A2", "A3", "B1", "B2", "A4", "B3", "A5", "B4"]
    assert (q.queued, q.queued_tokens) == (5, 2500)


def test_fast_forward_over_large_requests_matches_plain_rounds():
    class Plain(TenantRoundRobin):
        def _fast_forward(self) -> None:
            pass

    rng = random.Random(11)
    for _ in range(20):
        items = [Item(f"{t}{i}", t, rng.choice([0, 10, 700, 5000, 40_000])) for i in range(30) for t in "abcdefg"]
        rng.shuffle(items)
        fast, plain = TenantRoundRobin(512), Plain(512)
        for item in items:
            fast.push(item)
            plain.push(item)
        assert drain(fast) == drain(plain)
        assert (fast.queued, fast.queued_tokens) == (0, 0)


def test_remove_head_and_oldest():
    q = TenantRoundRobin(quantum=100)
    a1, a2, b1 = Item("a1", "a", 10, 1.0), Item("a2", "a", 20, 2.0), Item("b1", "b", 30, 0.5)
    for item in (a1, a2, b1):
        q.push(item)
    assert q.head("a") is a1 and q.head("c") is None and q.oldest_enqueued_at() == 0.5
    assert q.remove(b1) and not q.remove(b1) and not q.remove(Item("x", "zz", 1))
    assert q.oldest_enqueued_at() == 1.0 and (q.queued, q.queued_tokens) == (2, 30)
    assert q.remove(a1) and q.head("a") is a2
    assert drain(q) == ["a2"] and q.oldest_enqueued_at() is None and q.pop() is None


@pytest.mark.parametrize("quantum", [0, -5, 1.5, True])
def test_quantum_must_be_a_positive_whole_number(quantum):
    with pytest.raises(ValueError, match="quantum_tokens"):
        TenantRoundRobin(quantum)
