"""The replicas of one model, across its pools (regions): which are in, which are healthy or draining, how busy
each is, and the choice of one for a request — the nearest pool with free capacity, then the routing policy
(cache-aware with bounded load by default) inside it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tokenfleet.router.catalog import ModelSpec
from tokenfleet.router.health import HealthTracker
from tokenfleet.router.load import LoadReport, Upstream
from tokenfleet.router.policies import Choice, NoReplicaAvailable, RoutingPolicy
from tokenfleet.router.replica_state import ReplicaState, ReportMark

log = logging.getLogger(__name__)


@dataclass
class Replica:
    name: str
    url: str
    pool: str
    kind: str  # tokenfleet | openai
    upstream: Upstream
    state: ReplicaState
    draining: bool = False  # takes no new requests; in-flight ones finish
    role: str = "both"  # both | prefill (computes prompts' KV for decode replicas only) | decode


@dataclass
class Route:
    """One routing decision, kept for the request's log line and its usage record."""

    model: str
    replica: str
    pool: str
    reason: str
    matched_blocks: int
    skipped: int = 0
    rule: str | None = None
    attempt: int = 1

    def describe(self) -> str:
        rule = f" rule={self.rule}" if self.rule else ""
        return (
            f"model={self.model}{rule} pool={self.pool} replica={self.replica} reason={self.reason} "
            f"cached_blocks={self.matched_blocks} skipped={self.skipped} attempt={self.attempt}"
        )


@dataclass
class ModelPools:
    spec: ModelSpec
    health: HealthTracker
    policy: RoutingPolicy
    slots_per_replica: int
    replicas: dict[str, Replica] = field(default_factory=dict)
    block_size: int = 16
    remote_prefill_min_tokens: int = 64
    latency_ms: dict[str, float] = field(default_factory=dict)  # pool -> latency from this gateway

    def __post_init__(self) -> None:
        self.latency_ms = {p.name: p.latency_ms for p in self.spec.pools}

    def add(
        self,
        name: str,
        url: str,
        pool: str,
        kind: str,
        make_upstream: Callable[[str, str], Upstream],
        role: str = "both",
    ) -> None:
        if name in self.replicas:
            return
        self.replicas[name] = Replica(name, url, pool, kind, make_upstream(url, name), ReplicaState(name), role=role)
        self.latency_ms.setdefault(pool, 0.0)
        self.health.add(name, url, pool)
        log.info("replica %s (%s) joined %s/%s as %s", name, url, self.spec.name, pool, role)

    def remove(self, name: str) -> Replica | None:
        replica = self.replicas.pop(name, None)
        if replica is not None:
            self.health.remove(name)
            self.policy.forget(name)
            log.info("replica %s left %s", name, self.spec.name)
        return replica

    def set_draining(self, name: str, draining: bool = True) -> bool:
        replica = self.replicas.get(name)
        if replica is None:
            return False
        if replica.draining == draining:
            return True
        replica.draining = draining
        log.info("replica %s %s", name, "draining: no new requests" if draining else "back in rotation")
        return True

    def update_load(self, name: str, report: LoadReport, mark: ReportMark | None = None) -> None:
        """`mark`: the replica's ReplicaState.mark() from when the report was asked for (None: now)."""
        replica = self.replicas.get(name)
        if replica is not None:
            replica.state.reported(report.running, report.waiting, report.queued_tokens, report.kv_usage, mark)
            if report.prefill_tokens_total is not None:
                replica.state.count_prefill(report.prefill_tokens_total, report.fetched_at)

    def taking(self) -> int:
        """Replicas taking new work (not draining)."""
        return sum(not r.draining for r in self.replicas.values())

    def prefill_tokens_per_s(self, unmeasured: float) -> float:
        """The prefill rate of the replicas taking work together: each one's as measured, `unmeasured` for one not
        measured yet."""
        return sum(r.state.prefill_tokens_per_s or unmeasured for r in self.replicas.values() if not r.draining)

    def can_serve(self) -> bool:
        """Whether a request can be sent anywhere: a replica that is not draining (healthy, or ejected ones when
        none is: see choose)."""
        return any(not r.draining for r in self.replicas.values())

    def choose(
        self, token_ids: Sequence[int], affinity: str | None = None, exclude: Sequence[str] = ()
    ) -> tuple[Replica, Choice]:
        """The nearest pool that has a healthy replica with room; inside it, the policy's choice."""
        usable, panic = self._usable(exclude)
        for pool in self._pools_nearest_first(usable):
            members = [r for r in usable if r.pool == pool]
            if any(r.state.load() < self.slots_per_replica for r in members) or pool == self._last_resort(usable):
                choice = self.policy.choose([r.state for r in members], token_ids, affinity)
                replica = self.replicas[choice.replica]
                self.health.begin_request(replica.name)
                return replica, replace(choice, reason=f"panic:{choice.reason}") if panic else choice
        raise NoReplicaAvailable(f"no healthy replica of {self.spec.name}")  # unreachable: last resort chooses

    def wants_remote_prefill(self, decode: Replica, num_prompt_tokens: int, matched_blocks: int) -> bool:
        """Whether a request going to this decode replica should have its prompt computed by a prefill replica:
        enough of it is not cached there yet (the router's view of that replica's prefix cache)."""
        uncached = num_prompt_tokens - matched_blocks * self.block_size
        return decode.role == "decode" and uncached >= self.remote_prefill_min_tokens

    def choose_prefill(self, token_ids: Sequence[int], decode: Replica, exclude: Sequence[str] = ()) -> Replica | None:
        """A prefill replica for a request going to a decode replica: in the decode replica's pool if one is
        healthy there, else the nearest; None when no healthy prefill replica is left (the decode replica then
        computes the prompt itself)."""
        usable = [
            r
            for r in self.replicas.values()
            if r.role == "prefill" and not r.draining and r.name not in exclude and self.health.available(r.name)
        ]
        if not usable:
            return None
        same_pool = [r for r in usable if r.pool == decode.pool]
        nearest = same_pool or [r for r in usable if r.pool == self._pools_nearest_first(usable)[0]]
        choice = self.policy.choose([r.state for r in nearest], token_ids, None)
        self.health.begin_request(choice.replica)
        return self.replicas[choice.replica]

    def _usable(self, exclude: Sequence[str]) -> tuple[list[Replica], bool]:
        """The healthy replicas that generate (not prefill-only ones), not draining nor excluded; when there is
        none, the ejected ones (Envoy's panic mode: an ejection is a guess, failing for sure is worse), with
        True."""
        candidates = [
            r for r in self.replicas.values() if not r.draining and r.name not in exclude and r.role != "prefill"
        ]
        healthy = [r for r in candidates if self.health.available(r.name)]
        if healthy:
            return healthy, False
        if not candidates:
            raise NoReplicaAvailable(f"no healthy replica of {self.spec.name}")
        log.warning(
            "no healthy replica of %s: trying the ejected ones (%s)",
            self.spec.name,
            ", ".join(r.name for r in candidates),
        )
        return candidates, True

    def _pools_nearest_first(self, usable: list[Replica]) -> list[str]:
        return sorted({r.pool for r in usable}, key=lambda p: (self.latency_ms.get(p, 0.0), p))

    def _last_resort(self, usable: list[Replica]) -> str:
        """When every pool is full: the one with the most room left (then the nearest)."""

        def room(pool: str) -> float:
            members = [r for r in usable if r.pool == pool]
            return sum(self.slots_per_replica - r.state.load() for r in members) / len(members)

        return max(self._pools_nearest_first(usable), key=room)

    def started(self, replica: Replica) -> None:
        replica.state.begin()

    def finished(self, replica: Replica, failure: str | None = None, ttft_s: float | None = None) -> None:
        replica.state.end()
        if failure is None:
            self.health.record_success(replica.name, ttft_s)
        elif failure == "cancelled":
            self.health.release(replica.name)
        else:
            self.health.record_failure(replica.name, failure)

    def snapshot(self) -> list[dict[str, Any]]:
        health = self.health.snapshot()
        return [
            {
                "name": r.name,
                "url": r.url,
                "pool": r.pool,
                "kind": r.kind,
                "role": r.role,
                "draining": r.draining,
                "in_flight": r.state.in_flight,
                "load": round(r.state.load(), 3),
                "health": health_word(health.get(r.name, {}).get("state"), r.draining),
                "breaker": health.get(r.name, {}).get("state") or "closed",
            }
            for r in self.replicas.values()
        ]


def health_word(breaker: str | None, draining: bool) -> str:
    """A replica's health as operators read it: healthy, ejected (its breaker is open), half-open (on probation)
    or draining (no new requests)."""
    if draining:
        return "draining"
    return {"open": "ejected", "half_open": "half-open"}.get(breaker or "closed", "healthy")
