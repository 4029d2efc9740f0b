"""The least loaded healthy replica, ignoring the cache; ties taken in turn so an idle pool is not all sent to the
first one."""

from __future__ import annotations

from tokenfleet.router.policies.in_turn import InTurn
from tokenfleet.router.replica_state import ReplicaState


class LeastLoadedPolicy(InTurn):
    reason = "least_loaded"

    def candidates(self, healthy: list[ReplicaState]) -> list[ReplicaState]:
        loads = [r.load() for r in healthy]
        return [r for r, load in zip(healthy, loads) if load == min(loads)]
