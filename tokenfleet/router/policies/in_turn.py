"""What the policies that ignore the cache share: of their candidates, each takes the next in turn."""

from __future__ import annotations

from tokenfleet.router.policies.base import Choice, Placement, RoutingPolicy
from tokenfleet.router.replica_state import ReplicaState


class InTurn(RoutingPolicy):
    reason = ""

    def __init__(self) -> None:
        self._turn = 0

    def place(self, request: Placement) -> Choice:
        candidates = self.candidates(request.healthy)
        self._turn += 1
        return Choice(candidates[(self._turn - 1) % len(candidates)].name, self.reason, 0, 0)

    def candidates(self, healthy: list[ReplicaState]) -> list[ReplicaState]:
        return healthy

    def forget(self, replica: str) -> None:
        pass
