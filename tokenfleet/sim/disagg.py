"""Separate prefill and decode pools (disaggregated serving) in the simulator.

A request that gets its slot goes to a prefill replica (the router's real policy over the prefill pool), which runs
it as a request for one token: the engine's own scheduler prefills it (prefix cache included) and samples the first
token, which streams to the client at once, so TTFT ends there. Its KV cache then moves to a decode replica (the
least loaded of the decode pool), and the decode replica generates the rest.

The move is modelled as a copy over the link into the decode replica, one transfer at a time per replica (FIFO):
    transfer = latency + prompt tokens x KV bytes per token / (link bandwidth x efficiency)
The transferred blocks are written into the decode replica's block manager before the request joins its
scheduler, held by a placeholder until the request is admitted (the scheduler then finds them as prefix hits and
computes only the prompt's last partial block and the first token's KV, under 17 tokens). When the decode replica
has no room for them, the request joins without them and its prompt is recomputed there (counted as `recomputed`).
The gap from the first token to the second (transfer, waiting for the decode replica, its step) counts as an
inter-token gap, so the time-per-output-token SLO sees it.

Cancellations are not modelled in this layout (the workload must have cancel_probability 0).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenfleet.engine.request import Request, SamplingParams
from tokenfleet.sim.fleet import Fleet, FleetSetup, make_policy
from tokenfleet.sim.hardware import GB
from tokenfleet.sim.replica import SimReplica
from tokenfleet.sim.request import SimRequest


@dataclass(frozen=True)
class DisaggSpec:
    prefill_replicas: int
    decode_replicas: int
    kv_bytes_per_token: int  # the model's, in the KV cache's dtype
    link_bytes_per_s: float = 50 * GB  # into each decode replica: one 400 Gb/s NIC (RDMA)
    link_efficiency: float = 0.8
    transfer_latency_s: float = 0.002  # per transfer: handshake, block table, completion
    prefill_batched_tokens: int | None = None  # the prefill pool's token budget per step (None: the engine's)

    def __post_init__(self) -> None:
        if self.prefill_replicas < 1 or self.decode_replicas < 1:
            raise ValueError("a disaggregated fleet needs at least one prefill and one decode replica")
        if not self.link_bytes_per_s > 0 or not 0 < self.link_efficiency <= 1 or self.transfer_latency_s < 0:
            raise ValueError("link_bytes_per_s > 0, 0 < link_efficiency <= 1 and transfer_latency_s >= 0")

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_latency_s + tokens * self.kv_bytes_per_token / (
            self.link_bytes_per_s * self.link_efficiency
        )


@dataclass(eq=False)
class _Flight:
    """One request across the two pools."""

    sreq: SimRequest
    stage: SimRequest  # the prefill request, then the decode one
    decode: SimReplica | None = None
    holder: Request | None = None  # holds the transferred blocks until the decode replica admits the request


class DisaggFleet(Fleet):
    def __init__(self, setup: FleetSetup, spec: DisaggSpec) -> None:
        if setup.workload.cancel_probability > 0:
            raise ValueError("the disaggregated layout does not model cancellations: set cancel_probability 0")
        total = spec.prefill_replicas + spec.decode_replicas
        super().__init__(replace(setup, replicas=total))
        self.spec = spec
        self._replace_prefill_pool()
        self.prefill = self.replicas[: spec.prefill_replicas]
        self.decode = self.replicas[spec.prefill_replicas :]
        self.states = [r.state for r in self.prefill]  # the gateway's router picks among the prefill pool
        self.decode_policy = make_policy("least_loaded", setup.spec.block_size, setup.load_bound)
        self.flights: dict[SimRequest, _Flight] = {}
        self.link_free_at = {r.name: 0.0 for r in self.decode}
        self.transfers = self.recomputed = 0
        self.transfer_s_total = 0.0
        self.decode_prompt_tokens = self.decode_cached_tokens = 0

    def _replace_prefill_pool(self) -> None:
        s, budget = self.setup, self.spec.prefill_batched_tokens
        if budget is None:
            return
        spec = replace(s.spec, scheduler=replace(s.spec.scheduler, max_num_batched_tokens=budget))
        for i in range(self.spec.prefill_replicas):
            self.replicas[i] = SimReplica(self.replicas[i].name, spec, s.cost, self.events, self, s.fast)
        self.by_name = {r.name: r for r in self.replicas}

    # --- prefill ----------------------------------------------------------------------------------------------

    def _dispatch(self, sreq: SimRequest) -> None:
        hashes = sreq.hashes[: len(sreq.prompt) // self.setup.spec.block_size]
        affinity = f"conv-{sreq.conversation}" if self.setup.affinity else None
        replica = self.by_name[self.policy.choose(self.states, sreq.prompt, affinity, hashes).replica]
        stage = SimRequest(
            f"{sreq.rid}/prefill",
            sreq.tier,
            sreq.tenant,
            sreq.user,
            sreq.priority,
            sreq.prompt,
            sreq.output[:1],
            sreq.hashes,
            sreq.arrival,
            sreq.conversation,
            sreq.turn,
        )
        self.flights[stage] = _Flight(sreq, stage)
        replica.state.in_flight += 1
        self.in_flight += 1
        replica.add(stage)

    def finished(self, stage: SimRequest, now: float, reason: str) -> None:
        """A stage ended on `stage.replica`. Fleet.finished settles the request (and that replica's in_flight)."""
        flight = self.flights.pop(stage)
        sreq = flight.sreq
        sreq.replica, sreq.req = stage.replica, stage.req
        sreq.preemptions += stage.preemptions
        if flight.decode is not None:
            self.decode_prompt_tokens += len(stage.prompt)
            self.decode_cached_tokens += stage.cached_tokens  # the transferred KV, found as prefix hits
            sreq.tokens_out = 1 + stage.tokens_out
            super().finished(sreq, now, "length")
            return
        sreq.first_token = sreq.last_token = now  # prefill done: the first token is out
        sreq.cached_tokens, sreq.tokens_out = stage.cached_tokens, 1
        if sreq.max_tokens <= 1:
            super().finished(sreq, now, "length")
        else:
            self.by_name[stage.replica].state.in_flight -= 1
            self._transfer(flight, now)

    # --- transfer and decode ----------------------------------------------------------------------------------

    def _transfer(self, flight: _Flight, now: float) -> None:
        sreq = flight.sreq
        hashes = sreq.hashes[: len(sreq.prompt) // self.setup.spec.block_size]
        flight.decode = decode = self.by_name[
            self.decode_policy.choose([r.state for r in self.decode], sreq.prompt, None, hashes).replica
        ]
        decode.state.in_flight += 1
        took = self.spec.transfer_s(len(sreq.prompt))
        done = max(now, self.link_free_at[decode.name]) + took
        self.link_free_at[decode.name] = done
        self.transfers += 1
        self.transfer_s_total += took
        self.events.at(done, self._arrived, flight)

    def _arrived(self, flight: _Flight) -> None:
        """The KV is on the decode replica: into its block manager, and the request into its scheduler."""
        sreq, decode = flight.sreq, flight.decode
        flight.holder = install_kv(decode, sreq)
        self.recomputed += flight.holder is None
        stage = SimRequest(
            f"{sreq.rid}/decode",
            sreq.tier,
            sreq.tenant,
            sreq.user,
            sreq.priority,
            sreq.prompt + sreq.output[:1],
            sreq.output[1 : sreq.max_tokens],
            sreq.hashes,
            sreq.arrival,
            sreq.conversation,
            sreq.turn,
        )
        flight.stage = stage
        self.flights[stage] = flight
        decode.add(stage)

    def first_token(self, stage: SimRequest, now: float) -> None:
        flight = self.flights.get(stage)
        if flight is None or flight.decode is None:
            return
        if flight.holder is not None:  # admitted: the request holds the blocks itself now
            flight.decode.blocks.free_request(flight.holder)
            flight.holder = None
        self.inter_token(stage.tier, now - flight.sreq.first_token, 1)  # first to second token, transfer included

    def _cancel(self, sreq: SimRequest) -> None:  # cancel_probability is 0 (checked at start)
        raise AssertionError("cancellations are not modelled in the disaggregated layout")


def install_kv(replica: SimReplica, sreq: SimRequest) -> Request | None:
    """Writes the full blocks of the request's prompt into the replica's block manager (as a transfer does),
    registered in its prefix cache and held by a placeholder request; None when there is no room for them."""
    blocks = replica.blocks
    size = blocks.block_size
    full = len(sreq.prompt) // size * size
    if not full:
        return None
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    holder = Request(f"{sreq.rid}/kv", sreq.prompt[:full], params, block_hashes=sreq.hashes[: full // size])
    if not blocks.allocate(holder, full):
        return None
    blocks.mark_computed(holder, full)  # the transfer wrote its KV
    return holder
