"""The fleet in simulated time: conversations arrive at a gateway (ladder, quota, fair queue), the router's real
policy picks a replica, replicas step their real schedulers, and answers bring the next turn after a pause."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tokenfleet.dispatch.overload import OverloadLadder, OverloadSettings
from tokenfleet.dispatch.queue import Dispatcher
from tokenfleet.dispatch.tiers import TierConfig
from tokenfleet.quota.memory import MemoryQuota
from tokenfleet.router.policies import make_policy
from tokenfleet.router.policies.load_bound import DEFAULT_ABSOLUTE
from tokenfleet.sim.cost_model import CostModel
from tokenfleet.sim.events import EventQueue, SimClock
from tokenfleet.sim.gateway import SimGateway
from tokenfleet.sim.metrics import Metrics, Slo
from tokenfleet.sim.replica import ReplicaSpec, SimReplica
from tokenfleet.sim.request import SimRequest
from tokenfleet.sim.workload import Conversation, Workload, WorkloadSpec


@dataclass
class FleetSetup:
    replicas: int
    spec: ReplicaSpec
    cost: CostModel
    workload: WorkloadSpec
    tiers: dict[str, TierConfig]
    slo: Slo
    duration_s: float
    seed: int = 0
    warmup_s: float = 0.0
    drain_s: float = 120.0  # after the last arrival, in-flight work gets this long to finish
    policy: str = "cache_aware"
    load_bound: float = 1.25  # the router's load bound: relative slack ...
    load_slack: float = DEFAULT_ABSOLUTE  # ... and absolute slack, in sequences (tokenfleet/router/settings.py)
    affinity: bool = True  # route by conversation id (x-conversation-id), as the chat product does
    overload: OverloadSettings = field(default_factory=OverloadSettings)
    slots_per_replica: int = 256
    quantum_tokens: int = 2048
    load_interval_s: float = 1.0
    quota: bool = True
    fast: bool = True
    gpus_per_replica: int = 1
    kv_bytes_per_token: int = 0  # one token's KV cache: what moving a prompt between pools costs (disagg)
    describe: dict = field(default_factory=dict)  # what the report prints about the setup


class Fleet:
    def __init__(self, setup: FleetSetup) -> None:
        self.setup = s = setup
        self.clock = SimClock()
        self.events = EventQueue(self.clock)
        self.metrics = Metrics(s.slo, since=s.warmup_s)
        self.replicas = [
            SimReplica(f"replica-{i}", s.spec, s.cost, self.events, self, s.fast) for i in range(s.replicas)
        ]
        self.by_name = {r.name: r for r in self.replicas}
        self.states = [r.state for r in self.replicas]  # the replicas the router may choose: not draining
        self.draining: set[str] = set()
        self._next_replica = s.replicas
        self.policy = make_policy(s.policy, s.spec.block_size, s.load_bound, s.load_slack)
        self.gateway = SimGateway(
            s.tiers,
            self.clock,
            OverloadLadder(s.overload, self.clock),
            Dispatcher(s.tiers, s.slots_per_replica * s.replicas, s.quantum_tokens, clock=self.clock),
            MemoryQuota(clock=self.clock) if s.quota else None,
        )
        self.workload = Workload(s.workload, s.seed, s.spec.block_size)
        self.prefill_tokens_per_s = 2048 / s.cost.prefill_time(2048)
        self.conversations: dict[int, Conversation] = {}
        self.capacity_tokens = (
            s.spec.num_blocks - max(1, int(s.spec.watermark * s.spec.num_blocks))
        ) * s.spec.block_size
        self.in_flight = 0
        self.requests_seen = 0  # every turn that arrived, warm-up included
        self.max_level = 0
        self.level_seconds = [0.0] * 5
        # replicas over the run (autoscaling adds and removes them): the report counts removed ones too
        self.removed: list[SimReplica] = []
        self.joined_at: dict[str, float] = {}  # when a replica added during the run joined (else: 0)
        self.removed_at: dict[str, float] = {}
        self.peak_replicas = s.replicas

    @property
    def end_s(self) -> float:
        return self.setup.duration_s + self.setup.drain_s

    def run(self) -> Fleet:
        self.events.at(self.workload.next_start(), self._conversation_starts)
        self.events.at(0.0, self._load_tick)
        self.events.run(until=self.end_s)
        return self

    # --- arrivals -------------------------------------------------------------------------------------------

    def _conversation_starts(self) -> None:
        conv = self.workload.conversation()
        self.conversations[conv.cid] = conv
        self._turn(conv)
        start = self.workload.next_start()
        if start < self.setup.duration_s:
            self.events.at(start, self._conversation_starts)

    def _turn(self, conv: Conversation) -> None:
        sreq = self.workload.next_turn(conv, self.clock.now, self.setup.tiers[conv.tier].priority)
        if sreq is None:
            del self.conversations[conv.cid]
            return
        self.requests_seen += 1
        if sreq.status == "length":  # prompt + answer exceed max_model_len: the gateway's 400, arrived and refused
            self.metrics.too_long(sreq)
            del self.conversations[conv.cid]
            return
        self.metrics.arrived(sreq)
        if len(sreq.prompt) + sreq.max_tokens > self.capacity_tokens:
            self._refused(sreq, conv, "rejected")
            return
        why = self.gateway.admit(sreq, self._dispatch)
        if why is not None:
            self._refused(sreq, conv, why)
        elif sreq.cancel_after is not None:
            self.events.after(sreq.cancel_after, self._cancel, sreq)

    def _refused(self, sreq: SimRequest, conv: Conversation, why: str) -> None:
        self.metrics.refused(sreq, why)
        del self.conversations[conv.cid]

    def _dispatch(self, sreq: SimRequest) -> None:
        """The request has its slot: the router picks the replica, which queues it for its next step."""
        hashes = sreq.hashes[: len(sreq.prompt) // self.setup.spec.block_size]
        affinity = f"conv-{sreq.conversation}" if self.setup.affinity else None
        choice = self.policy.choose(self.states, sreq.prompt, affinity, hashes)
        replica = self.by_name[choice.replica]
        replica.state.in_flight += 1
        self.in_flight += 1
        replica.add(sreq)

    def _cancel(self, sreq: SimRequest) -> None:
        if sreq.finished is not None or sreq.status != "pending":
            return
        if self.gateway.withdraw(sreq):  # still in the fair queue: it never reached a replica
            sreq.status, sreq.finished = "cancelled", self.clock.now
            self.gateway.leave(sreq)
            self.metrics.ended(sreq)
            self.conversations.pop(sreq.conversation, None)
        elif sreq.req is not None:
            self.by_name[sreq.replica].abort(sreq)

    # --- what replicas report -------------------------------------------------------------------------------

    def first_token(self, sreq: SimRequest, now: float) -> None:
        pass

    def finished(self, sreq: SimRequest, now: float, reason: str) -> None:
        sreq.finished = now
        sreq.status = "ok" if reason == "length" else "cancelled"
        self.by_name[sreq.replica].state.in_flight -= 1
        self.in_flight -= 1
        self.gateway.leave(sreq)
        self.metrics.ended(sreq)
        conv = self.conversations.get(sreq.conversation)
        if conv is None:
            return
        if sreq.status == "ok" and now < self.setup.duration_s:
            self.workload.answered(conv, sreq)
            self.events.after(self.workload.think_time(conv), self._turn, conv)
        else:
            del self.conversations[conv.cid]

    def inter_token(self, tier: str, gap_s: float, count: int) -> None:
        if self.clock.now >= self.setup.warmup_s:
            self.metrics.inter_token(tier, gap_s, count)

    def inter_tokens(self, gap_s: float, per_tier: dict[str, int]) -> None:
        if self.clock.now >= self.setup.warmup_s:
            self.metrics.inter_tokens(gap_s, per_tier)

    def inter_token_gaps(self, gaps_s: list[float], ends: list[float], per_tier: dict[str, int]) -> None:
        """Several steps' gaps for the same decodes (a replica's run of parked steps), step i ending at ends[i]."""
        skip = bisect.bisect_left(ends, self.setup.warmup_s) if ends and ends[0] < self.setup.warmup_s else 0
        if skip < len(gaps_s):
            self.metrics.inter_tokens_many(gaps_s[skip:], per_tier)

    def _load_tick(self) -> None:
        queued = sum(r.report().queued_tokens for r in self.replicas)
        interval = self.setup.load_interval_s
        level = self.gateway.update_load(
            len(self.states), self.setup.slots_per_replica, queued, self.prefill_tokens_per_s
        )
        self.max_level = max(self.max_level, level)
        self.level_seconds[level] += interval
        if self.clock.now + interval < self.end_s:
            self.events.after(interval, self._load_tick)

    # --- a fleet that changes size (tokenfleet/sim/autoscaling.py) -----------------------------------------------

    def add_replica(self) -> SimReplica:
        """A new replica, serving at once (its cold start is the caller's business); the router may choose it."""
        s = self.setup
        replica = SimReplica(f"replica-{self._next_replica}", s.spec, s.cost, self.events, self, s.fast)
        self._next_replica += 1
        self.replicas.append(replica)
        self.by_name[replica.name] = replica
        self.joined_at[replica.name] = self.clock.now
        self.peak_replicas = max(self.peak_replicas, len(self.replicas))
        self._serving_changed()
        return replica

    def set_draining(self, name: str, draining: bool) -> None:
        """Draining: the router sends it nothing new; what it holds runs to the end (as the router's drain mark)."""
        if name not in self.by_name:
            raise KeyError(f"no replica {name!r}")
        (self.draining.add if draining else self.draining.discard)(name)
        self._serving_changed()

    def idle(self, name: str) -> bool:
        """Nothing running, queued or on its way to the replica: it can be stopped without dropping a request."""
        replica = self.by_name[name]
        return not replica.busy and not replica.has_work() and replica.state.in_flight == 0

    def remove_replica(self, name: str) -> SimReplica:
        """Stops a drained, idle replica; refuses one that still holds requests."""
        if name not in self.draining or not self.idle(name):
            raise ValueError(f"replica {name} must be drained and idle before it is removed")
        replica = self.by_name.pop(name)
        self.replicas.remove(replica)
        self.removed.append(replica)  # its steps, preemptions and busy time still count in the report
        self.removed_at[name] = self.clock.now
        self.draining.discard(name)
        self._serving_changed()
        return replica

    @property
    def all_replicas(self) -> list[SimReplica]:
        """Every replica of the run: those removed by the autoscaler, then those still here."""
        return self.removed + self.replicas

    def replica_seconds(self) -> float:
        """Seconds replicas were part of the fleet (from joining to removal, or to now), all replicas together."""
        now = self.clock.now
        if not self.removed and not self.joined_at:  # a fixed fleet
            return len(self.replicas) * now
        return sum(self.removed_at.get(r.name, now) - self.joined_at.get(r.name, 0.0) for r in self.all_replicas)

    def _serving_changed(self) -> None:
        self.states = [r.state for r in self.replicas if r.name not in self.draining]
