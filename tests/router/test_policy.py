from __future__ import annotations

import random
from collections import Counter

import pytest

from tokenfleet.router.policies import (
    CacheAwarePolicy,
    Choice,
    LeastLoadedPolicy,
    NoReplicaAvailable,
    RoundRobinPolicy,
)
from tokenfleet.router.prefix import prompt_hashes
from tokenfleet.router.replica_state import ReplicaState


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(n)]


def pool(n: int = 4, **loads: int) -> list[ReplicaState]:
    return [ReplicaState(f"r{i}", in_flight=loads.get(f"r{i}", 0)) for i in range(n)]


def test_next_turn_goes_where_its_history_is() -> None:
    policy, replicas = CacheAwarePolicy(), pool()
    turn1 = tokens(200, seed=1)
    first = policy.choose(replicas, turn1)
    assert first.reason == "new" and first.matched_blocks == 0
    turn2 = turn1 + tokens(100, seed=2)
    second = policy.choose(replicas, turn2)
    assert second == Choice(first.replica, "prefix", 200 // 16, 0)
    assert policy.choose(replicas, turn2).replica == first.replica  # a regenerate: the same prompt again


def test_an_overloaded_holder_is_passed_over_for_the_least_loaded() -> None:
    policy, replicas = CacheAwarePolicy(), pool()
    prompt = tokens(320, seed=3)
    home = policy.choose(replicas, prompt).replica
    # 5 against 1: within the bound's absolute slack (8 sequences), the holder keeps its prompt's next turn.
    for r in replicas:
        r.in_flight = 5 if r.name == home else 1
    assert policy.choose(replicas, prompt + tokens(60, seed=5)) == Choice(home, "prefix", 20, 0)
    for r in replicas:
        r.in_flight = 10 if r.name == home else 2
    choice = policy.choose(replicas, prompt + tokens(50, seed=4))
    assert choice.replica != home and choice.candidates_skipped == 1 and choice.reason == "least_loaded"


def test_queued_prefill_below_a_slot_does_not_push_the_holder_over_the_bound() -> None:
    """The routing benchmark's case: 12 in flight over 4 replicas, the conversation's replica has a short prompt
    queued. Its next turn must stay there (the bound counts whole requests)."""
    policy = CacheAwarePolicy()
    history = tokens(50 * 16, seed=8)
    replicas = [ReplicaState(f"r{i}", in_flight=3) for i in range(4)]
    holder = policy.choose(replicas, history).replica
    next(r for r in replicas if r.name == holder).queued_tokens = 100
    choice = policy.choose(replicas, history + tokens(32, seed=9))
    assert choice.replica == holder and choice.reason == "prefix" and choice.matched_blocks == 50


def test_new_prefixes_spread_even_when_the_load_reports_are_stale() -> None:
    """Failure mode (b): misses must not all go to whichever replica looked least loaded at that instant. Other
    gateways' sequences come from a report (stale between two polls), but this router's own count moves with each
    request it sends, so new prompts fill the gap and then spread."""
    policy, replicas = CacheAwarePolicy(), pool()
    for r in replicas[1:]:
        r.reported(running=3, waiting=0, queued_tokens=0, kv_usage=0.0)  # another gateway's 3, never refreshed
    by_name = {r.name: r for r in replicas}
    counts = Counter()
    for s in range(400):
        name = policy.choose(replicas, tokens(64, seed=s)).replica
        by_name[name].begin()  # what the pool does when the request starts (none finishes here)
        counts[name] += 1
    assert len(counts) == 4 and max(r.load() for r in replicas) - min(r.load() for r in replicas) <= 1, counts
    assert counts["r0"] == counts["r1"] + 3


def test_new_prompts_with_equal_load_spread_over_the_ring() -> None:
    """Equally loaded replicas (here: a load figure that never changes) do not all get the new prompts of the first
    one listed."""
    policy, replicas = CacheAwarePolicy(), pool(r0=1, r1=1, r2=1, r3=1)
    counts = Counter(policy.choose(replicas, tokens(64, seed=s)).replica for s in range(400))
    assert len(counts) == 4 and max(counts.values()) <= 0.35 * 400, counts


def test_a_hot_system_prompt_is_spread_by_the_bound_and_the_index_learns_its_holders() -> None:
    """Failure mode (a): everyone shares the first blocks; it must not all collapse onto one replica."""
    system = tokens(16 * 20, seed=7)
    for fanout in (2, 0):  # with and without the shared-prefix refinement: the bound alone must spread it too
        policy, replicas = CacheAwarePolicy(shared_fanout=fanout), pool()
        by_name = {r.name: r for r in replicas}
        for user in range(40):  # none finishes: in_flight only grows
            by_name[policy.choose(replicas, system + tokens(40, seed=100 + user)).replica].in_flight += 1
        loads = sorted(r.in_flight for r in replicas)
        assert loads[-1] <= 13 and loads[0] >= 4, (fanout, loads)  # 13 = ceil(1.25 x 40 / 4)
        assert len(policy.index.matches(prompt_hashes(system, 16))) >= 3


def test_new_conversations_on_a_shared_prefix_spread_even_at_low_load() -> None:
    """The first holders of a system prompt must not get every new conversation while others sit idle."""
    system = tokens(16 * 20, seed=8)
    policy, replicas = CacheAwarePolicy(), pool()
    counts = Counter(policy.choose(replicas, system + tokens(40, seed=200 + c)).replica for c in range(200))
    assert len(counts) == 4 and max(counts.values()) <= 0.35 * 200, counts


def test_affinity_key_keeps_a_conversation_on_one_replica_and_spreads_conversations() -> None:
    policy, replicas = CacheAwarePolicy(), pool()
    homes = {policy.choose(replicas, tokens(10 + turn, seed=turn), affinity="conv-1").replica for turn in range(20)}
    assert len(homes) == 1
    choice = policy.choose(replicas, tokens(100, seed=99), affinity="conv-1")
    assert choice.reason == "affinity" and choice.replica in homes
    # A prompt with a known prefix goes to its holder first; affinity orders the rest (here: under a block, no prefix).
    spread = Counter(policy.choose(replicas, tokens(10, seed=0), affinity=f"conv-{c}").replica for c in range(200))
    assert len(spread) == 4 and max(spread.values()) <= 0.35 * 200, spread


def test_unhealthy_replicas_are_never_chosen() -> None:
    policy, replicas = CacheAwarePolicy(), pool()
    prompt = tokens(160, seed=9)
    home = policy.choose(replicas, prompt).replica
    next(r for r in replicas if r.name == home).healthy = False
    assert all(policy.choose(replicas, prompt + tokens(20, seed=s)).replica != home for s in range(50))
    for r in replicas:
        r.healthy = False
    for p in (CacheAwarePolicy(), LeastLoadedPolicy(), RoundRobinPolicy()):
        with pytest.raises(NoReplicaAvailable):
            p.choose(replicas, prompt)


def test_forget_and_pool_changes() -> None:
    policy, replicas = CacheAwarePolicy(), pool(3)
    prompt = tokens(160, seed=10)
    home = policy.choose(replicas, prompt).replica
    policy.forget(home)
    assert home not in policy.ring and policy.index.matches(prompt_hashes(prompt, 16)) == {}
    bigger = pool(5)
    policy.choose(bigger, prompt)
    assert len(policy.ring) == 5
    # A subset (one pool, say) is chosen from without moving anyone on the ring.
    assert all(policy.choose(bigger[:2], tokens(64, seed=s)).replica in ("r0", "r1") for s in range(20))
    assert len(policy.ring) == 5


def test_prompts_shorter_than_a_block_still_route() -> None:
    policy, replicas = CacheAwarePolicy(), pool()
    assert policy.choose(replicas, [1, 2, 3]).matched_blocks == 0
    assert policy.choose(replicas, []).reason == "new"


def test_round_robin_and_least_loaded() -> None:
    replicas = pool(3, r0=2, r2=1)
    replicas[1].healthy = False
    assert [RoundRobinPolicy().choose(replicas, [])] == [Choice("r0", "round_robin", 0, 0)]
    rr = RoundRobinPolicy()
    assert [rr.choose(replicas, []).replica for _ in range(4)] == ["r0", "r2", "r0", "r2"]
    assert LeastLoadedPolicy().choose(replicas, []) == Choice("r2", "least_loaded", 0, 0)
    ll, idle = LeastLoadedPolicy(), pool(3)
    assert [ll.choose(idle, []).replica for _ in range(3)] == ["r0", "r1", "r2"]  # ties taken in turn


def test_a_new_conversation_prefers_its_system_prompts_holder_only_while_about_as_idle_as_the_rest() -> None:
    """Placement (not an idle pool): a holder of the shared prefix wins among replicas within one sequence of the
    least loaded, and no further; its new conversations then go to the least loaded."""
    system = tokens(16 * 20, seed=21)
    policy, replicas = CacheAwarePolicy(), pool(r0=1, r1=1, r2=1, r3=1)
    by_name = {r.name: r for r in replicas}
    holder = policy.choose(replicas, system + tokens(40, seed=22)).replica
    policy.choose(replicas, system + tokens(40, seed=23))  # a second conversation: the system prompt is shared now
    for r in replicas:
        r.in_flight = 2 if r.name == holder else 1
    first = policy.choose(replicas, system + tokens(40, seed=24))
    assert (first.replica, first.reason, first.matched_blocks) == (holder, "new", 20)
    by_name[holder].in_flight = 3  # two above the least loaded: the prefix no longer tips it
    second = policy.choose(replicas, system + tokens(40, seed=25))
    assert second.replica != holder and second.reason == "new"
