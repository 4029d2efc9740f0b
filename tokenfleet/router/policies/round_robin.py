"""Each healthy replica in turn, ignoring load and cache: the baseline the other policies are measured against."""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.router.policies.base import Choice, healthy_replicas
from tokenfleet.router.replica_state import ReplicaState


class RoundRobinPolicy:
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
