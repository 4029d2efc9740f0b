"""The plain-ASGI front of the gateway app, in process: the completion routes it serves itself answer like the
FastAPI routes did (streams, JSON, OpenAI-shaped errors, 405 for a wrong method), and every /v1/ request is counted
by endpoint and status, whoever served it."""

from __future__ import annotations

import asyncio
import re

import httpx

from tests.gateway.inprocess import MODEL, inprocess_gateway
from tests.gateway.test_admission import RecordingUpstream
from tokenfleet.gateway.app import create_gateway_app


def requests_counted(gateway) -> dict[tuple[str, str], float]:
    text = gateway.render_metrics().decode()
    return {
        (endpoint, status): float(value)
        for endpoint, status, value in re.findall(
            r'tokenfleet_gateway_requests_total\{endpoint="([^"]*)",status="(\d+)"\} (\S+)', text
        )
    }


def test_completion_routes_answer_and_every_v1_request_is_counted(demo_model_dir):
    async def scenario():
        gateway = inprocess_gateway(demo_model_dir, [RecordingUpstream(count=2)])
        transport = httpx.ASGITransport(app=create_gateway_app(gateway))
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            whole = await client.post("/v1/chat/completions", json=chat)
            streamed = await client.post("/v1/chat/completions", json={**chat, "stream": True})
            native = await client.post("/v1/generate", json=chat)
            text = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            unknown_model = await client.post("/v1/chat/completions", json={**chat, "model": "nope"})
            not_json = await client.post("/v1/completions", content=b"{", headers={"content-type": "text/plain"})
            wrong_method = await client.get("/v1/chat/completions")
            models = await client.get("/v1/models")
            missing = await client.get("/v1/nothing-here")
            health = await client.get("/health")
        assert whole.status_code == 200 and whole.json()["choices"][0]["message"]["content"] == "t0t1"
        assert whole.headers["x-request-id"] == whole.json()["id"] and "x-resume-token" in whole.headers
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.rstrip().endswith("data: [DONE]")
        assert all(line.startswith("data: ") for line in streamed.text.splitlines() if line), "OpenAI sends no ids"
        assert "id: 1\n" in native.text
        assert "event: done" in native.text and '"delta": "t0"' in native.text
        assert text.status_code == 200 and text.json()["id"].startswith("cmpl-")
        assert unknown_model.status_code == 404 and unknown_model.json()["error"]["code"] == "model_not_found"
        assert not_json.status_code == 400 and set(not_json.json()["error"]) == {"message", "type", "param", "code"}
        assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
        assert models.status_code == 200 and missing.status_code == 404 and health.status_code == 200
        assert requests_counted(gateway) == {
            ("/v1/chat/completions", "200"): 2,
            ("/v1/generate", "200"): 1,
            ("/v1/completions", "200"): 1,
            ("/v1/chat/completions", "404"): 1,
            ("/v1/completions", "400"): 1,
            ("/v1/chat/completions", "405"): 1,
            ("/v1/models", "200"): 1,
            ("unknown", "404"): 1,
        }  # /health is not an API request: not counted

    asyncio.run(scenario())


def test_a_client_that_asks_for_a_resumable_stream_gets_the_event_ids(demo_model_dir):
    async def scenario():
        gateway = inprocess_gateway(demo_model_dir, [RecordingUpstream(count=3)])
        transport = httpx.ASGITransport(app=create_gateway_app(gateway))
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            streamed = await client.post("/v1/chat/completions", json=chat, headers={"x-tokenfleet-resumable": "true"})
        ids = [int(line[4:]) for line in streamed.text.splitlines() if line.startswith("id: ")]
        assert ids == list(range(1, len(ids) + 1)) and len(ids) >= 4  # three chunks and [DONE]
        request_id = streamed.headers["x-request-id"]
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            replay = await client.get(f"/v1/requests/{request_id}/stream", headers={"Last-Event-ID": str(ids[1])})
        assert [int(line[4:]) for line in replay.text.splitlines() if line.startswith("id: ")] == ids[2:]

    asyncio.run(scenario())


def test_openapi_and_docs_show_the_completion_routes_with_their_schemas(demo_model_dir):
    async def scenario():
        gateway = inprocess_gateway(demo_model_dir, [RecordingUpstream()])
        transport = httpx.ASGITransport(app=create_gateway_app(gateway))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.get("/openapi.json"), await client.get("/docs")

    spec, docs = asyncio.run(scenario())
    paths = spec.json()["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/generate"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].rsplit("/", 1)[-1] in spec.json()["components"]["schemas"], path
    chat = spec.json()["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages", "max_tokens", "stream"} <= set(chat["properties"])
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
