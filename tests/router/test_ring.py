from __future__ import annotations

from collections import Counter

from tokenfleet.router.ring import HashRing

KEYS = [f"key-{i}".encode() for i in range(10_000)]


def firsts(ring: HashRing) -> list[str]:
    return [ring.order(key)[0] for key in KEYS]


def test_order_lists_every_replica_once_and_is_deterministic() -> None:
    ring = HashRing([f"r{i}" for i in range(5)])
    order = ring.order(b"some key")
    assert sorted(order) == [f"r{i}" for i in range(5)]
    assert HashRing([f"r{i}" for i in reversed(range(5))]).order(b"some key") == order
    assert HashRing().order(b"x") == []


def test_keys_spread_evenly() -> None:
    counts = Counter(firsts(HashRing([f"r{i}" for i in range(4)])))
    assert all(0.18 <= n / len(KEYS) <= 0.32 for n in counts.values()), counts


def test_adding_a_replica_moves_about_one_nth_of_the_keys_and_only_to_it() -> None:
    ring = HashRing([f"r{i}" for i in range(4)])
    before = firsts(ring)
    ring.add("r4")
    after = firsts(ring)
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert 0.12 <= len(moved) / len(KEYS) <= 0.28  # ideal: 1/5
    assert all(a == "r4" for _, a in moved)


def test_removing_a_replica_moves_only_its_keys_and_keeps_everyone_elses_order() -> None:
    ring = HashRing([f"r{i}" for i in range(5)])
    orders = [ring.order(key) for key in KEYS[:2000]]
    ring.remove("r2")
    for key, order in zip(KEYS[:2000], orders):
        assert ring.order(key) == [r for r in order if r != "r2"]
    assert "r2" not in ring and len(ring) == 4
    ring.add("r2")
    assert [ring.order(key) for key in KEYS[:2000]] == orders
