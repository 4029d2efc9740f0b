"""Multi-turn chat through simulated replicas, each with a real engine KVBlockManager, under three routing policies.

Deterministic (seeded) and in process. A request occupies its replica (counts in its `in_flight`) for a time
proportional to its uncached prompt tokens plus its output tokens; a replica batches, so requests overlap rather
than queue, and the load the router sees is how many are in flight. A request's KV blocks are allocated,
computed, registered in the prefix cache and freed the way the engine does it, all at routing time (a conversation's
next turn only comes after its previous answer, so it sees that answer's blocks in the cache). Cache hits are
therefore the engine's own: blocks found by `match_prefix` under real LRU eviction on a cache of limited size.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Sequence

from tokenfleet.engine.kv_blocks import KVBlockManager, prefix_block_hashes
from tokenfleet.engine.request import Request, SamplingParams
from tokenfleet.router.policy import (CacheAwarePolicy, LeastLoadedPolicy, ReplicaState, RoundRobinPolicy,
                                      RoutingPolicy)

BLOCK_SIZE = 16
NUM_REPLICAS = 4
BLOCKS_PER_REPLICA = 1200  # 19k tokens of KV per replica; the active conversations need about 3x that
TOKENS_PER_TIME = 100.0  # a request takes (uncached prompt + output tokens) / TOKENS_PER_TIME units of time
VOCAB = 32_000


@dataclass
class Conversation:
    cid: str
    system: list[int]
    users: list[list[int]]  # one new user message per turn
    outputs: list[list[int]]  # the answer to each turn
    start: float
    thinks: list[float]  # pause after each answer before the next turn


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def make_workload(seed: int = 0, num_conversations: int = 240, mean_gap: float = 0.8, mean_think: float = 3.0
                  ) -> list[Conversation]:
    """Conversations arriving as a Poisson process; three system prompts, the first one hot."""
    rng = random.Random(seed)
    systems = [random_tokens(rng, n) for n in (960, 640, 320)]
    conversations, now = [], 0.0
    for c in range(num_conversations):
        now += rng.expovariate(1 / mean_gap)
        turns = rng.randint(3, 8)
        conversations.append(Conversation(
            cid=f"conv-{c}", system=rng.choices(systems, weights=(5, 3, 2))[0],
            users=[random_tokens(rng, rng.randint(20, 200)) for _ in range(turns)],
            outputs=[random_tokens(rng, rng.randint(30, 250)) for _ in range(turns)],
            start=now, thinks=[rng.expovariate(1 / mean_think) for _ in range(turns)]))
    return conversations


@dataclass
class SimReplica:
    state: ReplicaState
    kv: KVBlockManager
    work: int = 0  # tokens processed: uncached prompt + output
    requests: int = 0
    peak_in_flight: int = 0


@dataclass
class SimResult:
    hit_rate: float  # cached prompt tokens / prompt tokens
    imbalance: float  # max / mean of tokens processed per replica (= of time-averaged in_flight, in this model)
    peak_in_flight: int  # the most requests any replica had at once
    requests: list[int]  # per replica
    reasons: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        return (f"hit rate {self.hit_rate:.3f}  max/mean load {self.imbalance:.3f}  peak in flight "
                f"{self.peak_in_flight}  requests per replica {self.requests}  reasons {self.reasons}")


def run_on_kv(kv: KVBlockManager, request_id: str, prompt: list[int], hashes: list[bytes],
              output: list[int]) -> int:
    """Prefills the prompt (reusing cached blocks), decodes the output, frees it; returns the cached tokens."""
    req = Request(request_id, list(prompt), SamplingParams(max_tokens=len(output)))
    req.block_hashes = hashes[:len(prompt) // BLOCK_SIZE]  # known keys, so the sim does not pay to hash twice
    hits = kv.match_prefix(req)
    new = req.num_tokens - len(hits) * BLOCK_SIZE
    assert kv.can_admit(kv.admission_cost(req, hits, new))
    kv.admit(req, hits, new)
    req.num_computed_tokens += new
    for token in output:
        req.append_token(token)
    kv.grow(req, len(output) - 1)  # the last sampled token never gets its KV computed
    req.num_computed_tokens += len(output) - 1
    kv.cache_full_blocks(req)
    kv.free_request(req)
    return len(hits) * BLOCK_SIZE


class ChatSim:
    def __init__(self, policy: RoutingPolicy, replicas: Sequence[SimReplica], conversations: list[Conversation],
                 use_affinity: bool = False) -> None:
        self.policy, self.replicas, self.conversations = policy, list(replicas), conversations
        self.by_name = {r.state.name: r for r in self.replicas}
        self.use_affinity = use_affinity
        self.history = [list(c.system) for c in conversations]
        self.hashes: list[list[bytes]] = [[] for _ in conversations]
        self.events: list[tuple[float, int, str, int, int, str]] = []
        self.seq = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.reasons: dict[str, int] = {}
        self.requests_when_failed = 0

    def push(self, at: float, kind: str, conv: int, turn: int, replica: str = "") -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, conv, turn, replica))

    def run(self) -> SimResult:
        for c, conv in enumerate(self.conversations):
            self.push(conv.start, "arrive", c, 0)
        while self.events:
            now, _, kind, c, turn, replica = heapq.heappop(self.events)
            if kind == "arrive":
                self.arrive(now, c, turn)
            elif kind == "fail":
                self.by_name[replica].state.healthy = False
                self.requests_when_failed = self.by_name[replica].requests
            else:
                self.by_name[replica].state.in_flight -= 1
                conv = self.conversations[c]
                if turn + 1 < len(conv.users):
                    self.push(now + conv.thinks[turn], "arrive", c, turn + 1)
        return self.result()

    def arrive(self, now: float, c: int, turn: int) -> None:
        conv = self.conversations[c]
        prompt = self.history[c] + conv.users[turn]
        self.hashes[c] = prefix_block_hashes(prompt, BLOCK_SIZE, self.hashes[c])
        states = [r.state for r in self.replicas]
        choice = self.policy.choose(states, prompt, affinity=conv.cid if self.use_affinity else None)
        self.reasons[choice.reason] = self.reasons.get(choice.reason, 0) + 1
        replica = self.by_name[choice.replica]
        output = conv.outputs[turn]
        cached = run_on_kv(replica.kv, f"{conv.cid}-{turn}", prompt, self.hashes[c], output)
        self.history[c] = prompt + output
        self.prompt_tokens += len(prompt)
        self.cached_tokens += cached
        work = len(prompt) - cached + len(output)
        replica.work += work
        replica.requests += 1
        replica.state.in_flight += 1
        replica.peak_in_flight = max(replica.peak_in_flight, replica.state.in_flight)
        self.push(now + work / TOKENS_PER_TIME, "done", c, turn, replica.state.name)

    def result(self) -> SimResult:
        works = [r.work for r in self.replicas]
        return SimResult(self.cached_tokens / self.prompt_tokens, max(works) / (sum(works) / len(works)),
                         max(r.peak_in_flight for r in self.replicas), [r.requests for r in self.replicas],
                         dict(sorted(self.reasons.items())))


def make_replicas(count: int = NUM_REPLICAS, blocks: int = BLOCKS_PER_REPLICA) -> list[SimReplica]:
    return [SimReplica(ReplicaState(f"replica-{i}"), KVBlockManager(blocks, BLOCK_SIZE)) for i in range(count)]


def simulate(policy: RoutingPolicy, conversations: list[Conversation], use_affinity: bool = False) -> SimResult:
    return ChatSim(policy, make_replicas(), conversations, use_affinity).run()


def simulate_combined(conversations: list[Conversation]) -> SimResult:
    """The ideal: one replica with the whole fleet's cache, so nothing is ever routed away from a hit."""
    one = make_replicas(1, NUM_REPLICAS * BLOCKS_PER_REPLICA)
    return ChatSim(RoundRobinPolicy(), one, conversations).run()


def test_cache_aware_routing_keeps_hits_close_to_one_big_cache_and_stays_balanced() -> None:
    conversations = make_workload(seed=0)
    combined = simulate_combined(conversations)
    results = {"cache-aware": simulate(CacheAwarePolicy(block_size=BLOCK_SIZE), conversations),
               "round-robin": simulate(RoundRobinPolicy(), conversations),
               "least-loaded": simulate(LeastLoadedPolicy(), conversations)}
    report = "\n".join([f"{'one 4x cache':>13}: {combined}"] + [f"{name:>13}: {r}" for name, r in results.items()])
    print("\n" + report)
    cache_aware = results["cache-aware"]
    assert cache_aware.hit_rate >= 0.9 * combined.hit_rate, report
    assert cache_aware.imbalance <= 1.25, report
    assert results["round-robin"].hit_rate <= 0.75 * cache_aware.hit_rate, report
    assert results["least-loaded"].hit_rate <= 0.75 * cache_aware.hit_rate, report


def test_a_replica_failing_mid_run_gets_no_more_traffic_and_the_rest_stay_balanced() -> None:
    conversations = make_workload(seed=1, num_conversations=120)
    replicas = make_replicas()
    sim = ChatSim(CacheAwarePolicy(block_size=BLOCK_SIZE), replicas, conversations, use_affinity=True)
    failed = replicas[1]
    sim.push(conversations[60].start, "fail", -1, -1, failed.state.name)
    result = sim.run()
    assert failed.requests == sim.requests_when_failed, result
    survivors = [r.work for r in replicas if r is not failed]
    assert max(survivors) / (sum(survivors) / len(survivors)) <= 1.25, result
    assert result.hit_rate >= 0.8, result
