"""The router's load figure: its own live in-flight count plus only what the last load report knows that the router
does not (other gateways' sequences), never the larger of the two, so nothing is counted twice and nothing runs
ahead of the live count once the router's own requests finish."""

from __future__ import annotations

import asyncio
import time

from tokenfleet.router.catalog import ModelCatalog, ModelSpec, PoolSpec
from tokenfleet.router.load import LoadReport
from tokenfleet.router.replica_state import TOKENS_PER_SLOT, ReplicaState
from tokenfleet.router.router import Router
from tokenfleet.router.settings import RoutingSettings


def test_a_report_of_the_routers_own_requests_adds_nothing() -> None:
    state = ReplicaState("r")
    for _ in range(3):
        state.begin()
    state.reported(running=2, waiting=1, queued_tokens=0, kv_usage=0.1, mark=state.mark())
    assert state.load() == 3, "the report saw the same 3 requests: the old max() was right here, a sum would say 6"
    for _ in range(3):
        state.end()
    assert state.load() == 0, "they finished: the old max() kept saying 3 until the next report"


def test_what_the_report_saw_beyond_the_routers_own_is_added_once() -> None:
    state = ReplicaState("r")
    state.begin()
    state.begin()
    state.reported(running=5, waiting=2, queued_tokens=0, kv_usage=0.5, mark=state.mark())
    assert (state.unseen, state.load()) == (5, 7), "5 sequences of other gateways"
    state.begin()
    assert state.load() == 8, "this router's next request counts at once, on top (the old max() said 7)"
    state.end()
    state.end()
    assert state.load() == 6


def test_requests_sent_while_the_report_was_on_its_way_are_not_counted_twice() -> None:
    state = ReplicaState("r")
    state.begin()
    mark = state.mark()  # the router asks for a report with 1 request there
    state.begin()
    state.begin()  # two more go out before the answer comes; the replica counted them
    state.reported(running=3, waiting=0, queued_tokens=0, kv_usage=0.0, mark=mark)
    assert (state.unseen, state.load()) == (0, 3)


def test_a_report_behind_the_live_count_hides_nothing_and_queued_prefill_adds_work() -> None:
    state = ReplicaState("r")
    for _ in range(4):
        state.begin()
    state.reported(running=1, waiting=0, queued_tokens=TOKENS_PER_SLOT // 2, kv_usage=0.0, mark=state.mark())
    assert state.load() == 4.5, "3 had not reached the replica yet: the live count stands, plus half a slot of prefill"


class ScriptedUpstream:
    """A replica's load report that takes a while to come back, during which the router sends it more requests."""

    def __init__(self, report: LoadReport, meanwhile) -> None:
        self.report, self.meanwhile = report, meanwhile

    def stream(self, kind, body):  # pragma: no cover - not used here
        raise NotImplementedError

    async def load(self) -> LoadReport:
        await asyncio.sleep(0.01)
        self.meanwhile()
        return self.report


def test_the_router_reads_each_report_against_what_it_had_sent_when_it_asked() -> None:
    spec = ModelSpec("m", "/x", pools=[PoolSpec("near", ["http://a"])])
    upstreams: dict[str, ScriptedUpstream] = {}
    router = Router(
        ModelCatalog([spec]),
        RoutingSettings(load_interval_s=60),
        slots_per_replica=64,
        make_upstream=lambda url, name, kind: upstreams[url],
    )
    pools = router.models["m"]

    def send_two_more() -> None:
        for _ in range(2):
            pools.started(replica)

    # The replica counts this router's 1 + 2 requests and 4 of another gateway's.
    upstreams["http://a"] = ScriptedUpstream(LoadReport(5, 2, 0, 0.3, time.monotonic()), send_two_more)
    router.add_configured_replicas()
    replica = pools.replicas["http://a"]
    pools.started(replica)

    async def one_refresh() -> None:
        task = asyncio.create_task(router.refresh_loads())
        while replica.state.running == 0:
            await asyncio.sleep(0.005)
        task.cancel()

    asyncio.run(one_refresh())
    assert (replica.state.in_flight, replica.state.unseen, replica.state.load()) == (3, 4, 7)
    pools.finished(replica)
    assert replica.state.load() == 6
