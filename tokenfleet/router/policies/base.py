"""The one interface every routing policy has: choose a replica for a prompt among the router's replica states, and
forget a replica that left the pool. What a choice says, and the error when there is nothing to choose."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from tokenfleet.router.replica_state import ReplicaState


class NoReplicaAvailable(RuntimeError):
    """No healthy replica to send the request to."""


@dataclass
class Choice:
    replica: str
    # "affinity": where the conversation (x-conversation-id) lives; "prefix": it holds the prompt's own history;
    # "new": a prompt with no history anywhere, placed on the least loaded; "least_loaded": the preferred replica
    # was really busier than the least loaded one (see LoadBound); "round_robin": that policy
    reason: str  # "affinity" | "prefix" | "new" | "least_loaded" | "round_robin"
    matched_blocks: int  # leading prompt blocks the chosen replica is believed to hold
    candidates_skipped: int  # preferred candidates passed over because they were really busier than the least loaded


@dataclass(frozen=True)
class Placement:
    """One request to place, as a policy sees it."""

    replicas: Sequence[ReplicaState]  # the candidates as the caller passed them, healthy or not
    healthy: list[ReplicaState]  # of those, the healthy ones: never empty
    token_ids: Sequence[int]
    affinity: str | None  # a conversation id (x-conversation-id)
    hashes: Sequence[bytes] | None  # the prompt's block keys when the caller has them already (the fleet simulator)


class RoutingPolicy(ABC):
    """A policy implements `place`; `choose`, the entry every caller uses, is the same for all of them."""

    def choose(
        self,
        replicas: Sequence[ReplicaState],
        token_ids: Sequence[int],
        affinity: str | None = None,
        hashes: Sequence[bytes] | None = None,
    ) -> Choice:
        """One of the healthy `replicas` for the prompt; NoReplicaAvailable when none is healthy."""
        return self.place(Placement(replicas, healthy_replicas(replicas), token_ids, affinity, hashes))

    @abstractmethod
    def place(self, request: Placement) -> Choice:
        """The choice among `request.healthy`."""

    @abstractmethod
    def forget(self, replica: str) -> None:
        """The replica left the pool."""


def healthy_replicas(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    healthy = [r for r in replicas if r.healthy]
    if not healthy:
        raise NoReplicaAvailable(f"no healthy replica among {len(replicas)}")
    return healthy
