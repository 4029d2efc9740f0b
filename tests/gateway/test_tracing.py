"""One trace per request: the gateway's request span with its admission, queue wait and relay, a span per routing
attempt (with the first token as an event), and under it the replica's request with its prefill and decode, all in
one trace; a replica behind HTTP continues the trace its caller sent in `traceparent`. Spans are collected by the
OpenTelemetry SDK's in-memory exporter, over a real engine."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from opentelemetry import propagate, trace

from tests.gateway.inprocess import MODEL, inprocess_gateway
from tests.spans import span_exporter
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.config import EngineConfig
from tokenfleet.gateway.upstream import InProcessUpstream
from tokenfleet.replica.server import ReplicaService, create_app


@pytest.fixture(scope="module")
def spans():
    return span_exporter()


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    engine = AsyncEngine(
        EngineConfig.from_options(str(demo_model_dir), kv_cache_gib=0.05, swap_space_gib=0.01, max_model_len=512)
    )
    yield engine
    engine.shutdown()


def chat(max_tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens, "stream": True}


def test_a_request_through_the_gateway_is_one_trace(spans, engine):
    gateway = inprocess_gateway(engine.engine.config.model, [InProcessUpstream(ReplicaService(engine, MODEL))])

    async def main() -> str:
        relay = await gateway.admit("chat", chat(5), gateway.auth.open_caller)
        await relay.finished.wait()
        await asyncio.sleep(0)  # the relay's done callback ends its spans
        return relay.request_id

    spans.clear()
    request_id = asyncio.run(main())
    by_name = {s.name: s for s in spans.get_finished_spans()}
    expected = {"gateway.request", "admission", "queue_wait", "relay", "route", "replica.request", "prefill", "decode"}
    assert expected <= set(by_name), sorted(by_name)
    assert len({s.context.trace_id for s in by_name.values()}) == 1, "the spans are not one trace"

    def parent_of(name: str) -> str:
        parent_id = by_name[name].parent.span_id
        return next(n for n, s in by_name.items() if s.context.span_id == parent_id)

    assert {name: parent_of(name) for name in expected - {"gateway.request"}} == {
        "admission": "gateway.request",
        "queue_wait": "gateway.request",
        "relay": "gateway.request",
        "route": "relay",
        "replica.request": "route",
        "prefill": "replica.request",
        "decode": "replica.request",
    }
    root = by_name["gateway.request"]
    assert root.attributes["tokenfleet.request_id"] == request_id and root.attributes["gen_ai.usage.output_tokens"] == 5
    assert [e.name for e in by_name["route"].events] == ["first_token"]
    assert by_name["prefill"].end_time <= by_name["decode"].start_time
    assert root.start_time <= by_name["admission"].start_time and by_name["relay"].end_time <= root.end_time


def test_a_replica_continues_its_callers_trace(spans, engine):
    app = create_app(engine, MODEL)
    caller = trace.get_tracer("test").start_span("caller")
    headers: dict[str, str] = {}
    propagate.inject(headers, context=trace.set_span_in_context(caller))

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica") as client:
            return await client.post("/v1/chat/completions", json=chat(3), headers={**headers, "x-request-id": "r-1"})

    spans.clear()
    response = asyncio.run(main())
    caller.end()
    assert response.status_code == 200 and response.headers["x-request-id"] == "r-1"
    [replica] = [s for s in spans.get_finished_spans() if s.name == "replica.request"]
    assert replica.context.trace_id == caller.get_span_context().trace_id
    assert replica.parent.span_id == caller.get_span_context().span_id
    assert replica.attributes["tokenfleet.request_id"] == "r-1"
