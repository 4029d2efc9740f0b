"""A toy pool to drive the policy with: replicas serve `cold_start_s` after they are started, a demand (requests in
flight, 1 s each, so also requests/s) spreads over the ready ones, and what does not fit queues. Decisions are
applied the way the gateway's service applies them."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenfleet.autoscale import Autoscaler, Decision, PoolSignals, ReplicaSignals


@dataclass
class ToyReplica:
    name: str
    started_at: float
    ready_at: float
    draining: bool = False
    busy: int = 0  # work left on it (a drained replica keeps its requests until they finish)


@dataclass
class ToyPool:
    name: str
    cold_start_s: float
    slots: int = 10  # requests one replica runs at once
    replicas: dict[str, ToyReplica] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    started: int = 0

    def add(self, now: float, ready: bool = True) -> ToyReplica:
        self.started += 1
        name = f"{self.name}-{self.started}"
        replica = ToyReplica(name, now, now if ready else now + self.cold_start_s)
        self.replicas[name] = replica
        return replica

    def ready(self, now: float) -> list[ToyReplica]:
        return [r for r in self.replicas.values() if r.ready_at <= now and not r.draining]

    def signals(self, now: float, demand: float, rate: float | None = None) -> PoolSignals:
        ready = self.ready(now)
        capacity = len(ready) * self.slots
        running = min(int(demand), capacity)
        for i, r in enumerate(ready):
            r.busy = running // len(ready) + (i < running % len(ready))
        return PoolSignals(
            self.name,
            ready=len(ready),
            starting=sum(r.ready_at > now for r in self.replicas.values()),
            draining=sum(r.draining for r in self.replicas.values()),
            queued_requests=max(0, int(demand) - capacity),
            in_flight=sum(r.busy for r in self.replicas.values()),
            kv_usage_mean=running / capacity / 2 if capacity else 0.0,
            arrival_rate=demand if rate is None else rate,
            replicas=[
                ReplicaSignals(r.name, r.draining, running=r.busy, started_at=r.started_at)
                for r in self.replicas.values()
                if r.ready_at <= now
            ],
        )

    def apply(self, now: float, d: Decision) -> None:
        for name in d.undrain:
            self.replicas[name].draining = False
        for name in d.drain:
            self.replicas[name].draining = True
        for name in d.remove:
            assert self.replicas[name].draining and self.replicas[name].busy == 0, f"{name} removed while busy"
            del self.replicas[name]
            self.removed.append(name)
        for _ in range(d.start):
            self.add(now, ready=False)

    def finish_drained(self) -> None:
        for r in self.replicas.values():
            if r.draining:
                r.busy = 0


def run(policy: Autoscaler, pool: ToyPool, demand, start: float, end: float, step: float = 10.0):
    """Ticks from start to end; demand(t) -> requests in flight. Yields (t, signals, decision)."""
    t = start
    while t < end:
        signals = pool.signals(t, demand(t))
        decision = policy.decide(t, {pool.name: signals})[pool.name]
        pool.apply(t, decision)
        pool.finish_drained()
        yield t, signals, decision
        t += step
