"""Cache-aware routing under a load bound (the design's rule).

Per request:
1. hash the prompt's leading blocks exactly as the engine does and look them up in the prefix index;
2. find the replica the request belongs on:
   - a conversation this router has seen (the request's affinity key, x-conversation-id): where it lives, that is
     where its last turn ran (ConversationHomes), if that replica is still among the healthy candidates;
   - else the replicas believed to hold the prompt's own history: the deepest match first, equals least loaded first;
   - else nowhere: the prompt has no history anywhere (a new conversation, a one-off);
3. take it unless it is really busier than the least loaded replica (LoadBound: absolute and relative slack, in
   sequences and queued prefill). A prompt with nowhere to go, or whose replicas are all too busy, is placed: on the
   least loaded replica, or on one within PLACEMENT_SLACK of it that holds the shared prefix the prompt starts with;
   equals in consistent-hash ring order (keyed by the conversation id when there is one, else by the prompt's first
   block past its longest known prefix). So the ring only breaks ties, and only for conversations never seen;
4. record the prompt's blocks for the chosen replica in the prefix index, and the conversation's new home.

One refinement to step 2: when the prompt's known prefix ends at a block that earlier prompts already went on from
in several different ways (a system prompt, a tool list, a shared document), that prefix is shared, and the prompt
is a new branch of it: a new conversation. Holding a shared prefix is then a weak reason to prefer a replica (it
costs every other replica one prefill to get it, after which it stays hot there too), and preferring its holders
outright would send them every new conversation, and with them every later turn of those conversations. Such prompts
have nowhere to go, and their shared prefix only tips the placement between replicas about as idle as each other.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

from tokenfleet.router.policies.base import Choice, Placement, RoutingPolicy
from tokenfleet.router.policies.homes import DEFAULT_CONVERSATIONS, ConversationHomes
from tokenfleet.router.policies.load_bound import DEFAULT_ABSOLUTE, DEFAULT_RELATIVE, LoadBound
from tokenfleet.router.prefix import DEFAULT_MAX_BLOCKS, PrefixIndex, prompt_hashes
from tokenfleet.router.replica_state import ReplicaState
from tokenfleet.router.ring import HashRing

# A new conversation is worth only its shared prefix to a replica, so the prefix may tip the choice between replicas
# about as idle as each other, and no more: with 1, its holder takes new conversations while it runs at most 1 sequence
# more than the least loaded replica. (Simulating the routing benchmark's trace at 64 in flight, with SimReplicas:
# placing by load alone reached 93.6-94.9% of the ideal hit rate, every replica prefilling every system prompt; with
# this, 95.8-97.5%, and 97.6-98.8% at 8 in flight, max/mean requests per replica at most 1.16.)
PLACEMENT_SLACK = 1


class CacheAwarePolicy(RoutingPolicy):
    def __init__(
        self,
        block_size: int = 16,
        load_bound: float = DEFAULT_RELATIVE,
        load_slack: float = DEFAULT_ABSOLUTE,
        index: PrefixIndex | None = None,
        vnodes: int = 100,
        max_blocks: int | None = DEFAULT_MAX_BLOCKS,
        shared_fanout: int = 2,
        max_conversations: int = DEFAULT_CONVERSATIONS,
        placement_slack: int = PLACEMENT_SLACK,
    ) -> None:
        """`shared_fanout`: continuations after a block that make it a shared prefix (0 turns the refinement off)."""
        self.placement_slack = placement_slack
        self.block_size = block_size
        self.bound = LoadBound(load_bound, load_slack)
        self.max_blocks = max_blocks
        self.shared_fanout = shared_fanout
        self.index = index if index is not None else PrefixIndex()
        self.homes = ConversationHomes(max_conversations)
        self.ring = HashRing(vnodes=vnodes)

    def place(self, request: Placement) -> Choice:
        """Picks a replica and records the prompt's blocks (and the conversation's home) for it. The prompt's block
        keys (`prompt_hashes`) are computed unless the caller passed them."""
        healthy, token_ids, affinity, hashes = request.healthy, request.token_ids, request.affinity, request.hashes
        self._sync_ring(request.replicas)
        if hashes is None:
            hashes = prompt_hashes(token_ids, self.block_size, self.max_blocks)
        else:
            hashes = list(hashes[: self.max_blocks] if self.max_blocks is not None else hashes)
        by_name = {r.name: r for r in healthy}
        matched = {name: depth for name, depth in self.index.matches(hashes).items() if name in by_name}
        key = self._ring_key(token_ids, hashes, matched, affinity)
        in_ring = [by_name[name] for name in self.ring.order(key) if name in by_name]  # _sync_ring added them all
        preferred, reason = self._preferred(by_name, in_ring, hashes, matched, affinity)
        choice = self._pick(preferred, reason, self._placement(in_ring, matched), matched)
        self.index.record(hashes, choice.replica)
        if affinity is not None:
            self.homes.settle(affinity, choice.replica)
        return choice

    def forget(self, replica: str) -> None:
        """A replica left the pool: drop what the index believed it held, the conversations that lived there and
        its place on the ring."""
        self.index.forget(replica)
        self.homes.forget(replica)
        self.ring.remove(replica)

    def _sync_ring(self, replicas: Sequence[ReplicaState]) -> None:
        # Only ever adds: a replica leaves the ring through forget(). Callers may pass a subset of the replicas (one
        # pool, the healthy ones) and the ring order of a subset is the full order filtered, so nothing moves.
        for replica in replicas:
            if replica.name not in self.ring:
                self.ring.add(replica.name)

    def _preferred(
        self,
        by_name: dict[str, ReplicaState],
        in_ring: list[ReplicaState],
        hashes: list[bytes],
        matched: dict[str, int],
        affinity: str | None,
    ) -> tuple[list[ReplicaState], str]:
        """Where the request belongs, best first, and why: its conversation's home, else the holders of its own
        history; none for a prompt with no history (see the module's docstring)."""
        home = self.homes.get(affinity) if affinity is not None else None
        if home is not None and home in by_name:
            return [by_name[home]], "affinity"
        if not matched or self._branches_off_shared_prefix(hashes, max(matched.values())):
            return [], "new"
        holders = [r for r in in_ring if r.name in matched]
        holders.sort(key=lambda r: (-matched[r.name], r.load()))  # stable: equals stay in ring order
        return holders, "prefix"

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
        # keys and spread.
        return hashes[min(max(matched.values(), default=0), len(hashes) - 1)]

    def _placement(self, in_ring: list[ReplicaState], matched: dict[str, int]) -> list[ReplicaState]:
        """Where a prompt with nowhere to go is placed, best first: among the replicas about as idle as the least
        loaded (within `placement_slack` sequences), the deepest holder of the shared prefix it starts with (a
        system prompt, a document); then by load. Load in whole sequences (queued prefill under a sequence's worth,
        from a report up to a second old, does not break a tie); equals in ring order, so new conversations spread
        rather than pile up on whichever replica is listed first.

        An idle pool ignores the holders: a prefill costs no one any waiting then, and piling every new
        conversation on the first holder of a popular system prompt would leave the other replicas cold, and that
        replica the home of every conversation, for when load comes."""
        loads = {r.name: math.floor(r.load()) for r in in_ring}
        least = min(loads.values())
        if not any(loads.values()):
            matched = {}

        def rank(r: ReplicaState) -> tuple[int, int, int]:
            above = loads[r.name] - least
            return (0, -matched.get(r.name, 0), above) if above <= self.placement_slack else (1, 0, above)

        return sorted(in_ring, key=rank)  # stable: equals stay in ring order

    def _pick(
        self, preferred: list[ReplicaState], reason: str, placement: list[ReplicaState], matched: dict[str, int]
    ) -> Choice:
        least = min(r.load() for r in placement)
        for skipped, replica in enumerate(preferred):
            if not self.bound.too_busy(replica.load(), least):
                return Choice(replica.name, reason, matched.get(replica.name, 0), skipped)
        first = placement[0]
        return Choice(first.name, "least_loaded" if preferred else "new", matched.get(first.name, 0), len(preferred))
