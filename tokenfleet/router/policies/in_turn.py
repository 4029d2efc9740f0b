"""What the policies that ignore the cache share: of their candidates, each takes the next in turn."""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.router.policies.base import Choice, healthy_replicas
from tokenfleet.router.replica_state import ReplicaState


class InTurn:
    reason = ""

    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self,
        replicas: Sequence[ReplicaState],
        token_ids: Sequence[int],
        affinity: str | None = None,
        hashes: Sequence[bytes] | None = None,
    ) -> Choice:
        candidates = self.candidates(healthy_replicas(replicas))
        self._turn += 1
        return Choice(candidates[(self._turn - 1) % len(candidates)].name, self.reason, 0, 0)

    def candidates(self, healthy: list[ReplicaState]) -> list[ReplicaState]:
        return healthy

    def forget(self, replica: str) -> None:
        pass
