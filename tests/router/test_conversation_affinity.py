"""Conversation affinity remembers where a conversation lives (its first placement, then its last), with the hash
ring only for conversations never seen; a conversation whose replica is gone or unhealthy is placed anew there."""

from __future__ import annotations

import random

from tokenfleet.router.policies import CacheAwarePolicy
from tokenfleet.router.policies.homes import ConversationHomes
from tokenfleet.router.replica_state import ReplicaState


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(n)]


def pool(n: int = 4, load: int = 0) -> list[ReplicaState]:
    return [ReplicaState(f"r{i}", in_flight=load) for i in range(n)]


def ring_home(conversation: str) -> str:
    """Where the ring sends a conversation never seen, in an idle pool."""
    return CacheAwarePolicy().choose(pool(), tokens(100, seed=0), affinity=conversation).replica


def test_later_turns_follow_the_first_placement_where_the_ring_maps_elsewhere() -> None:
    policy, replicas = CacheAwarePolicy(), pool()
    ringed = ring_home("conv-7")
    next(r for r in replicas if r.name == ringed).in_flight = 2  # busy when the conversation starts
    first = policy.choose(replicas, tokens(100, seed=1), affinity="conv-7")
    assert first.replica != ringed and first.reason == "new"
    for r in replicas:
        r.in_flight = 1
    # Turns whose prompts share nothing with the first (a history trimmed to fit the window): only the memory of
    # where the conversation lives keeps them there.
    for turn in range(2, 8):
        choice = policy.choose(replicas, tokens(100, seed=turn), affinity="conv-7")
        assert (choice.replica, choice.reason) == (first.replica, "affinity")


def test_a_first_turn_placed_for_its_shared_system_prompt_keeps_its_later_turns() -> None:
    """The issue's case: the first turn went to a replica holding its shared system prompt; the ring maps the
    conversation id elsewhere, and the later turns used to go there and re-read the whole history."""
    policy, replicas = CacheAwarePolicy(), pool(load=1)
    system = tokens(16 * 20, seed=5)
    holder = policy.choose(replicas, system + tokens(40, seed=6)).replica
    others = [f"conv-{i}" for i in range(50) if ring_home(f"conv-{i}") != holder]
    conversation = others[0]
    history = system + tokens(40, seed=7)
    first = policy.choose(replicas, history, affinity=conversation)
    assert first.replica == holder, "placed where its system prompt is (all replicas equally busy)"
    for turn in range(3):
        history += tokens(60, seed=10 + turn)
        choice = policy.choose(replicas, history, affinity=conversation)
        assert (choice.replica, choice.reason) == (holder, "affinity")


def test_a_conversation_whose_replica_is_unhealthy_moves_and_then_lives_where_it_moved() -> None:
    policy, replicas = CacheAwarePolicy(), pool()
    history = tokens(300, seed=1)
    home = policy.choose(replicas, history, affinity="conv-1").replica
    down = next(r for r in replicas if r.name == home)
    down.healthy = False
    history += tokens(50, seed=2)
    moved = policy.choose(replicas, history, affinity="conv-1")
    assert moved.replica != home and moved.reason != "affinity"
    down.healthy = True
    history += tokens(50, seed=3)
    again = policy.choose(replicas, history, affinity="conv-1")
    assert (again.replica, again.reason) == (moved.replica, "affinity"), "its last placement, not its first"


def test_a_conversation_whose_replica_left_or_is_excluded_is_placed_anew() -> None:
    policy, replicas = CacheAwarePolicy(), pool()
    home = policy.choose(replicas, tokens(300, seed=1), affinity="conv-1").replica
    others = [r for r in replicas if r.name != home]
    retry = policy.choose(others, tokens(300, seed=1), affinity="conv-1")  # a failover excluding the replica
    assert retry.replica != home
    policy.choose(replicas, tokens(300, seed=4), affinity="conv-2")
    policy.forget(retry.replica)
    assert policy.homes.get("conv-1") is None, "a replica that left takes its conversations' homes with it"
    survivors = [r for r in replicas if r.name != retry.replica]
    assert policy.choose(survivors, tokens(300, seed=1), affinity="conv-1").replica != retry.replica


def test_homes_are_bounded_least_recently_seen_first_and_the_prefix_index_still_finds_a_forgotten_one() -> None:
    homes = ConversationHomes(max_conversations=2)
    homes.settle("a", "r0")
    homes.settle("b", "r1")
    homes.get("a")
    homes.settle("a", "r2")  # a's next turn: now the most recently seen
    homes.settle("c", "r3")
    assert (homes.get("a"), homes.get("b"), homes.get("c"), len(homes)) == ("r2", None, "r3", 2)

    policy, replicas = CacheAwarePolicy(max_conversations=1), pool()
    history = tokens(320, seed=1)
    home = policy.choose(replicas, history, affinity="conv-1").replica
    policy.choose(replicas, tokens(320, seed=2), affinity="conv-2")
    assert policy.homes.get("conv-1") is None
    choice = policy.choose(replicas, history + tokens(40, seed=3), affinity="conv-1")
    assert (choice.replica, choice.reason) == (home, "prefix")
