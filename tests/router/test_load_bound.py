"""The load bound acts only on a real imbalance: absolute AND relative slack, counted in sequences and queued
prefill, not in whole requests against the pool's average."""

from __future__ import annotations

import random

import pytest

from tokenfleet.router.policies import CacheAwarePolicy, LoadBound
from tokenfleet.router.replica_state import TOKENS_PER_SLOT, ReplicaState
from tokenfleet.router.settings import RoutingSettings, routing_from_dict


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(n)]


def test_a_replica_is_too_busy_only_above_both_slacks() -> None:
    bound = LoadBound(relative=1.25, absolute=8)
    assert not bound.too_busy(3, 0), "8 in flight over 4 replicas: 3 against an idle one is no imbalance"
    assert not bound.too_busy(7, 0), "with this request 8 above the idle one: not more than the absolute slack"
    assert bound.too_busy(8, 0)
    assert not bound.too_busy(100, 90), "11 above, but within 1.25 x: large counts need the relative slack too"
    assert bound.too_busy(40, 30), "11 above and more than 1.25 x"
    assert not LoadBound(relative=1.5, absolute=8).too_busy(40, 30)


def _conversation_on(policy: CacheAwarePolicy, replicas: list[ReplicaState]) -> tuple[list[int], str]:
    history = tokens(40 * 16, seed=1)
    return history, policy.choose(replicas, history, affinity="conv-1").replica


def test_a_small_imbalance_does_not_move_a_conversation() -> None:
    """The issue's case: 8 in flight over 4 replicas, the conversation's replica runs 4 of them, one replica idle.
    The old bound (1.25 x the average, whole requests) sent the turn away from its history here."""
    policy = CacheAwarePolicy()
    replicas = [ReplicaState(f"r{i}") for i in range(4)]
    history, home = _conversation_on(policy, replicas)
    for r, load in zip(sorted(replicas, key=lambda r: r.name != home), (4, 2, 2, 0)):
        r.in_flight = load
    choice = policy.choose(replicas, history + tokens(40, seed=2), affinity="conv-1")
    assert (choice.replica, choice.reason, choice.candidates_skipped) == (home, "affinity", 0)


def test_a_real_imbalance_moves_the_conversation_to_the_least_loaded() -> None:
    policy = CacheAwarePolicy()
    replicas = [ReplicaState(f"r{i}") for i in range(4)]
    history, home = _conversation_on(policy, replicas)
    for r, load in zip(sorted(replicas, key=lambda r: r.name != home), (12, 6, 5, 2)):
        r.in_flight = load
    least = min(replicas, key=lambda r: r.in_flight).name
    choice = policy.choose(replicas, history + tokens(40, seed=2), affinity="conv-1")
    assert (choice.replica, choice.reason, choice.candidates_skipped) == (least, "least_loaded", 1)
    later = policy.choose(replicas, history + tokens(80, seed=3), affinity="conv-1")
    assert later.replica == least and later.reason == "affinity", "the conversation now lives where it moved"


def test_queued_prefill_counts_as_work() -> None:
    """Two sequences, but 12 slots' worth of prompt waiting to be prefilled: really busier than an idle replica."""
    policy = CacheAwarePolicy()
    replicas = [ReplicaState(f"r{i}") for i in range(4)]
    history, home = _conversation_on(policy, replicas)
    holder = next(r for r in replicas if r.name == home)
    holder.in_flight = 2
    holder.queued_tokens = 12 * TOKENS_PER_SLOT
    assert holder.load() == 14
    choice = policy.choose(replicas, history + tokens(40, seed=2), affinity="conv-1")
    assert choice.replica != home and choice.reason == "least_loaded"
    holder.queued_tokens = TOKENS_PER_SLOT  # one slot's worth: no real imbalance
    back = policy.choose(replicas, history + tokens(40, seed=2) + tokens(40, seed=4), affinity="conv-1")
    assert back.replica == choice.replica, "no move back either: the conversation lives where it went"


def test_settings_take_both_slacks_and_refuse_bad_ones() -> None:
    settings = routing_from_dict({"load_bound": 1.5, "load_slack": 16}, "routing")
    assert (settings.load_bound, settings.load_slack) == (1.5, 16)
    assert (RoutingSettings().load_bound, RoutingSettings().load_slack) == (1.25, 8.0)
    for bad in ({"load_bound": 0.9}, {"load_slack": -1}, {"load_slack": float("nan")}, {"load_slack": "lots"}):
        with pytest.raises(ValueError, match="routing"):
            routing_from_dict(bad, "routing")
    with pytest.raises(ValueError):
        LoadBound(relative=1.0, absolute=-0.5)
