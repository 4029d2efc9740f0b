"""Where a request's first token waited: each request's trace is its timeline (the gateway's admission and queue
wait for a dispatch slot, the routing attempt, the engine's waiting queue, its prefill chunks, the first token), and
its stages follow one another and add up to the time to first token the gateway saw. Driven over a real engine
that runs two sequences at once and prefills 32 tokens per step, so that a burst of four waits in its queue."""

from __future__ import annotations

import asyncio

import pytest

from tests.gateway.inprocess import MODEL, inprocess_gateway
from tests.spans import span_exporter
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.config import EngineConfig
from tokenfleet.gateway.upstream import InProcessUpstream
from tokenfleet.replica.server import ReplicaService

BURST = 4
SLACK_NS = 2_000_000  # clock conversions (monotonic -> epoch) and span bookkeeping between stages


@pytest.fixture(scope="module")
def spans():
    return span_exporter()


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    config = EngineConfig.from_options(
        str(demo_model_dir),
        kv_cache_gib=0.05,
        swap_space_gib=0.01,
        max_model_len=512,
        max_num_seqs=2,
        max_num_batched_tokens=32,
    )
    engine = AsyncEngine(config)
    yield engine
    engine.shutdown()


def chat(n: int) -> dict:
    prompt = " ".join(f"word{n}x{i}" for i in range(40))  # ~100 tokens: several prefill chunks of 32
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "stream": True}


def timelines(finished) -> dict[int, dict[str, object]]:
    """Each trace's spans by name."""
    by_trace: dict[int, dict[str, object]] = {}
    for span in finished:
        by_trace.setdefault(span.context.trace_id, {})[span.name] = span
    return by_trace


def test_each_request_records_where_its_first_token_waited_and_the_stages_add_up(spans, engine):
    gateway = inprocess_gateway(engine.engine.config.model, [InProcessUpstream(ReplicaService(engine, MODEL))])

    async def burst() -> None:
        relays = [await gateway.admit("chat", chat(n), gateway.auth.open_caller) for n in range(BURST)]
        await asyncio.gather(*(relay.finished.wait() for relay in relays))
        await asyncio.sleep(0.05)  # the relays' done callbacks end their spans

    spans.clear()
    asyncio.run(burst())
    traces = [t for t in timelines(spans.get_finished_spans()).values() if "gateway.request" in t]
    assert len(traces) == BURST
    queued, prefills = [], []
    for t in traces:
        assert {"admission", "queue_wait", "route", "replica.request", "engine_queue", "prefill", "decode"} <= set(t)
        root, route, prefill = t["gateway.request"], t["route"], t["prefill"]
        [first_token] = [e.timestamp for e in route.events if e.name == "first_token"]
        assert prefill.attributes["tokenfleet.prefill_chunks"] >= 3, "a 100-token prompt in chunks of 32"
        stages = [
            (root.start_time, t["admission"].start_time),
            (t["admission"].start_time, t["admission"].end_time),
            (t["admission"].end_time, t["queue_wait"].start_time),
            (t["queue_wait"].start_time, t["queue_wait"].end_time),
            (t["queue_wait"].end_time, route.start_time),
            (route.start_time, t["replica.request"].start_time),
            (t["engine_queue"].start_time, t["engine_queue"].end_time),
            (prefill.start_time, prefill.end_time),
            (prefill.end_time, first_token),
        ]
        assert t["replica.request"].start_time == t["engine_queue"].start_time
        assert t["engine_queue"].end_time == prefill.start_time
        durations = [end - start for start, end in stages]
        assert min(durations) >= -SLACK_NS, f"stages out of order: {durations}"
        ttft = first_token - root.start_time
        assert sum(durations) == pytest.approx(ttft, abs=SLACK_NS), "the stages do not add up to the TTFT"
        named = durations[1] + durations[3] + durations[6] + durations[7]  # admission, slot, engine queue, prefill
        assert named >= 0.5 * ttft, f"most of the wait is in no named stage: {durations} of {ttft}"
        queued.append(durations[6])
        prefills.append(durations[7])
    queued.sort()
    # two run at once: two of the burst waited in the engine's queue until a request ended, its prefill included
    assert queued[-2] >= min(prefills), f"engine queue waits {queued}, prefills {prefills} (ns)"
