"""A single simulated replica driven by a list of requests, for the replica tests."""

from __future__ import annotations

import random

from tokenfleet.engine.kv_blocks import prefix_block_hashes
from tokenfleet.engine.scheduler import SchedulerConfig
from tokenfleet.sim.cost_model import CostModel, StepCoefficients
from tokenfleet.sim.events import EventQueue, SimClock
from tokenfleet.sim.replica import ReplicaSpec, SimReplica
from tokenfleet.sim.request import SimRequest

COST = CostModel(
    StepCoefficients(
        overhead_s=2e-3,
        per_sequence_s=1e-5,
        per_token_s=2e-5,
        per_attention_pair_s=1e-9,
        weights_s=5e-3,
        per_kv_token_s=2e-8,
    )
)


class Collect:
    def __init__(self) -> None:
        self.done: dict[str, tuple] = {}
        self.gaps: list[tuple[str, float, int]] = []
        self.finished_step: dict[str, int] = {}
        self.replica: SimReplica | None = None

    def first_token(self, sreq, now):
        pass

    def finished(self, sreq, now, reason):
        step = self.replica._step[0] if self.replica._step else self.replica.step_no
        self.finished_step[sreq.rid] = step
        self.done[sreq.rid] = (
            round(sreq.first_token or -1, 12),
            round(now, 12),
            reason,
            sreq.tokens_out,
            sreq.preemptions,
            sreq.cached_tokens,
        )

    def inter_token(self, tier, gap, count):
        self.gaps.append((tier, round(gap, 12), count))

    def inter_tokens(self, gap, per_tier):
        for tier, count in per_tier.items():
            if count:
                self.inter_token(tier, gap, count)


def make_requests(seed: int, n: int, rate: float, shared: int = 256, priorities=(0, 1, 2)) -> list[SimRequest]:
    rng = random.Random(seed)
    system = list(range(100_000, 100_000 + shared))
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        user = [i * 1000 + j for j in range(rng.randint(20, 400))]
        prompt = system + user
        answer = [7_000_000 + i * 1000 + j for j in range(rng.randint(5, 300))]
        pr = rng.choice(priorities)
        cancel = rng.uniform(0.05, 2.0) if rng.random() < 0.1 else None
        out.append(
            SimRequest(
                f"r{i}",
                ("paid", "free", "batch")[pr],
                "org",
                "u",
                pr,
                prompt,
                answer,
                prefix_block_hashes(prompt + answer, 16),
                t,
                cancel_after=cancel,
            )
        )
    return out


def run_replica(
    requests: list[SimRequest],
    num_blocks: int = 400,
    fast: bool = True,
    host_blocks: int = 200,
    max_num_seqs: int = 32,
    budget: int = 512,
    swap_threshold: int = 128,
    at_once: bool = False,
    runs: bool = True,
    before=None,
):
    """Runs the requests on one replica; at_once: all queued before the first step (an offline batch); runs:
    runs of parked steps as one event; before(events, replica): called before the run (to schedule probes)."""
    clock = SimClock()
    events = EventQueue(clock)
    sink = Collect()
    spec = ReplicaSpec(
        num_blocks=num_blocks,
        num_host_blocks=host_blocks,
        scheduler=SchedulerConfig(max_num_seqs, budget, swap_threshold),
    )
    replica = SimReplica("r0", spec, COST, events, sink, fast=fast)
    replica.runs = runs
    sink.replica = replica
    if before is not None:
        before(events, replica)
    if at_once:
        events.at(0.0, replica.add_many, requests)
    for sreq in requests:
        if not at_once:
            events.at(sreq.arrival, replica.add, sreq)
        if sreq.cancel_after is not None:
            events.at(sreq.arrival + sreq.cancel_after, replica.abort, sreq)
    events.run()
    return replica, sink
