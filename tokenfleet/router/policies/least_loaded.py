"""The least loaded healthy replica, ignoring the cache; ties taken in turn so an idle pool is not all sent to the
first one."""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.router.policies.base import Choice, healthy_replicas
from tokenfleet.router.replica_state import ReplicaState


class LeastLoadedPolicy:
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
