"""Replica choice: cache-aware with bounded load (the design's rule), and two plain policies to compare it with.

Cache-aware, per request:
1. hash the prompt's leading blocks exactly as the engine does and look them up in the prefix index;
2. rank the healthy replicas: those believed to hold the longest prefix first (equal matches: least loaded first),
   then the rest in consistent-hash ring order, keyed by the affinity key when given (a conversation id), else by
   the first block past the longest known prefix (for a prompt with no known prefix: its first block);
3. take the first replica that stays within `load_bound` x the pool's average load counting this request (rounded
   up to a whole request); if none does, the least loaded;
4. record the prompt's blocks for the chosen replica, so the next turn finds them there.

One refinement to step 2: when the prompt's known prefix ends at a block that earlier prompts already went on from
in several different ways (a system prompt, a tool list, a shared document), that prefix is shared, and the prompt
is a new branch of it: a new conversation. Holding a shared prefix is then no reason to prefer a replica (it costs
every other replica one prefill to get it, after which it stays hot), while preferring its first holders would send
them every new conversation and leave a replica without it idle whenever load is too low for the bound to spill.
Such prompts are ranked by the ring alone; the bound still applies.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenfleet.router.prefix import DEFAULT_MAX_BLOCKS, PrefixIndex, prompt_hashes
from tokenfleet.router.ring import HashRing

# Queued prefill tokens worth one request slot: the engine's default per-step token budget, so a replica with
# 2048 tokens of prefill queued is about one step (one running request's worth of delay) busier.
TOKENS_PER_SLOT = 2048


class NoReplicaAvailable(RuntimeError):
    """No healthy replica to send the request to."""


@dataclass
class ReplicaState:
    name: str
    in_flight: int = 0  # what this router sent and has not finished (its own count, always fresh)
    running: int = 0  # the rest is the replica's last load report (GET /load)
    waiting: int = 0
    queued_tokens: int = 0  # prefill tokens of queued requests
    kv_usage: float = 0.0
    healthy: bool = True

    def load(self) -> float:
        """How busy, in request slots.

        `in_flight` is fresh but counts only this router's requests; `running + waiting` counts every router's but
        is as old as the last report. The max lets neither hide load the other sees. Queued prefill tokens add the
        work that a count of requests misses (a waiting 8k-token prompt delays the next request far more than a
        waiting 10-token one). `kv_usage` is left out: it says how close the replica is to preempting, which the
        replica handles itself, and counting it would push traffic away from replicas that are merely warm.
        """
        return max(self.in_flight, self.running + self.waiting) + self.queued_tokens / TOKENS_PER_SLOT


@dataclass
class Choice:
    replica: str
    # "prefix": it holds the prompt's own prefix; "affinity" / "ring": ring order (keyed by the affinity key or the
    # prompt), which may still land on a holder of a shared prefix; "least_loaded": everyone was over the bound
    reason: str  # "prefix" | "affinity" | "ring" | "least_loaded" | "round_robin"
    matched_blocks: int  # leading prompt blocks the chosen replica is believed to hold
    candidates_skipped: int  # preferred candidates passed over because they were over the load bound


class RoutingPolicy(Protocol):
    def choose(
        self,
        replicas: Sequence[ReplicaState],
        token_ids: Sequence[int],
        affinity: str | None = None,
        hashes: Sequence[bytes] | None = None,
    ) -> Choice: ...

    def forget(self, replica: str) -> None: ...


def healthy_replicas(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    healthy = [r for r in replicas if r.healthy]
    if not healthy:
        raise NoReplicaAvailable(f"no healthy replica among {len(replicas)}")
    return healthy


class CacheAwarePolicy:
    def __init__(
        self,
        block_size: int = 16,
        load_bound: float = 1.25,
        index: PrefixIndex | None = None,
        vnodes: int = 100,
        max_blocks: int | None = DEFAULT_MAX_BLOCKS,
        shared_fanout: int = 2,
    ) -> None:
        """`shared_fanout`: continuations after a block that make it a shared prefix (0 turns the refinement off)."""
        if load_bound < 1.0:
            raise ValueError("load_bound must be at least 1.0")
        self.block_size = block_size
        self.load_bound = load_bound
        self.max_blocks = max_blocks
        self.shared_fanout = shared_fanout
        self.index = index if index is not None else PrefixIndex()
        self.ring = HashRing(vnodes=vnodes)

    def choose(
        self,
        replicas: Sequence[ReplicaState],
        token_ids: Sequence[int],
        affinity: str | None = None,
        hashes: Sequence[bytes] | None = None,
    ) -> Choice:
        """Picks a replica and records the prompt's blocks for it in the prefix index. `hashes`: the prompt's block
        keys (`prompt_hashes`) when the caller has them already (the fleet simulator), else they are computed."""
        healthy = healthy_replicas(replicas)
        self._sync_ring(replicas)
        if hashes is None:
            hashes = prompt_hashes(token_ids, self.block_size, self.max_blocks)
        else:
            hashes = list(hashes[: self.max_blocks] if self.max_blocks is not None else hashes)
        names = {r.name for r in healthy}
        matched = {name: depth for name, depth in self.index.matches(hashes).items() if name in names}
        by_prefix = bool(matched) and not self._branches_off_shared_prefix(hashes, max(matched.values()))
        ranked = self._rank(healthy, matched if by_prefix else {}, self._ring_key(token_ids, hashes, matched, affinity))
        choice = self._pick(ranked, matched, by_prefix, "affinity" if affinity is not None else "ring")
        self.index.record(hashes, choice.replica)
        return choice

    def forget(self, replica: str) -> None:
        """A replica left the pool: drop what the index believed it held and its place on the ring."""
        self.index.forget(replica)
        self.ring.remove(replica)

    def _sync_ring(self, replicas: Sequence[ReplicaState]) -> None:
        # Only ever adds: a replica leaves the ring through forget(). Callers may pass a subset of the replicas (one
        # pool, the healthy ones) and the ring order of a subset is the full order filtered, so nothing moves.
        for replica in replicas:
            if replica.name not in self.ring:
                self.ring.add(replica.name)

    def _branches_off_shared_prefix(self, hashes: list[bytes], depth: int) -> bool:
        # A conversation's next turn extends its previous prompt, whose last block nothing went on from yet; a new
        # conversation leaves its system prompt's last block, which other conversations already went on from.
        # A prompt matched to its end (a regenerate) is never a branch.
        return (
            0 < self.shared_fanout
            and depth < len(hashes)
            and self.index.continuations(hashes[depth - 1]) >= self.shared_fanout
        )

    def _ring_key(
        self, token_ids: Sequence[int], hashes: list[bytes], matched: dict[str, int], affinity: str | None
    ) -> bytes:
        if affinity is not None:
            return b"affinity:" + affinity.encode()
        if not hashes:  # shorter than one block: nothing is cached anyway, just spread by content
            return array("q", token_ids).tobytes()
        # The first block past the longest known prefix is where this prompt diverges from everything seen so far
        # (for a prompt with no known prefix, its first block). Prompts sharing only a system prompt get different
        # keys and spread; a conversation whose history the index lost keeps its key from turn to turn.
        return hashes[min(max(matched.values(), default=0), len(hashes) - 1)]

    def _rank(self, healthy: list[ReplicaState], matched: dict[str, int], key: bytes) -> list[ReplicaState]:
        """Replicas holding part of the prompt first (the deepest, then the least loaded), then the rest in ring
        order whatever their load: ordering those by load would send every new prefix to the replica that looked
        least loaded at that instant."""
        by_name = {r.name: r for r in healthy}
        in_ring = [by_name[name] for name in self.ring.order(key) if name in by_name]  # all: _sync_ring added them
        if not matched:
            return in_ring
        holders = [r for r in in_ring if r.name in matched]
        holders.sort(key=lambda r: (-matched[r.name], r.load()))  # stable: equals stay in ring order
        return holders + [r for r in in_ring if r.name not in matched]

    def _capacity(self, loads: Sequence[float]) -> int:
        """The most load a replica may have after taking this request (bounded-load consistent hashing).

        load_bound x the pool's average counting this request, rounded up to a whole request: with four idle
        replicas the average is 0.25 and one request must still fit. Rounding up rather than adding a constant
        keeps the bound tight as load grows: an additive guard of one request lets the replicas already holding
        a hot prefix absorb everything while a replica without it sits idle.
        """
        return math.ceil(self.load_bound * (sum(loads) + 1) / len(loads) - 1e-9)

    def _pick(self, ranked: list[ReplicaState], matched: dict[str, int], by_prefix: bool, ring_reason: str) -> Choice:
        loads = [r.load() for r in ranked]
        # The bound counts whole requests: queued prefill below a slot's worth must not push a replica that holds
        # the conversation over it (that sent later turns away from their cache in the routing benchmark).
        whole = [math.floor(load) for load in loads]
        capacity = self._capacity(whole)
        for skipped, (replica, load) in enumerate(zip(ranked, whole)):
            if load + 1 <= capacity:
                depth = matched.get(replica.name, 0)
                return Choice(replica.name, "prefix" if by_prefix and depth else ring_reason, depth, skipped)
        skipped = min(range(len(ranked)), key=loads.__getitem__)  # first of the least loaded: the best ranked
        return Choice(ranked[skipped].name, "least_loaded", matched.get(ranked[skipped].name, 0), skipped)


class LeastLoadedPolicy:
    """The least loaded healthy replica; ties taken in turn so an idle pool is not all sent to the first one."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self,
        replicas: Sequence[ReplicaState],
        token_ids: Sequence[int],
        affinity: str | None = None,
        hashes: Sequence[bytes] | None = None,
    ) -> Choice:
        healthy = healthy_replicas(replicas)
        loads = [r.load() for r in healthy]
        tied = [r for r, load in zip(healthy, loads) if load == min(loads)]
        self._turn += 1
        return Choice(tied[(self._turn - 1) % len(tied)].name, "least_loaded", 0, 0)

    def forget(self, replica: str) -> None:
        pass


class RoundRobinPolicy:
    """Each healthy replica in turn, ignoring load and cache."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self,
        replicas: Sequence[ReplicaState],
        token_ids: Sequence[int],
        affinity: str | None = None,
        hashes: Sequence[bytes] | None = None,
    ) -> Choice:
        healthy = healthy_replicas(replicas)
        self._turn += 1
        return Choice(healthy[(self._turn - 1) % len(healthy)].name, "round_robin", 0, 0)

    def forget(self, replica: str) -> None:
        pass


POLICIES = ("cache_aware", "least_loaded", "round_robin")


def make_policy(name: str, block_size: int, load_bound: float) -> RoutingPolicy:
    """The one factory of routing policies, for the gateway's router and the simulator alike."""
    if name == "cache_aware":
        return CacheAwarePolicy(block_size=block_size, load_bound=load_bound)
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")
