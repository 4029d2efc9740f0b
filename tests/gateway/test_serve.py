"""`tokenfleet serve` as a real process: the openai SDK, raw SSE (ids, headers), resume, cancel, disconnects."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import yaml

from tests.servers import abandon_stream, free_port, metric, running_process, wait_idle

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [
        "serve",
        "--model",
        str(demo_model_dir),
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--kv-cache-gib",
        "0.05",
        "--swap-space-gib",
        "0.01",
        "--max-model-len",
        "2048",
        "--disconnect-grace",
        "0.5",
        "--safety-hook",
        "tests.gateway.hooks:refuse_forbidden",
        "--database-url",
        f"sqlite:///{logs / 'serve.db'}",
    ]
    with running_process(args, f"{base}/health", logs / "serve.log"):
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def stream_body(max_tokens: int = 12, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


RESUMABLE = {"x-tokenfleet-resumable": "true"}  # event ids on an OpenAI stream, to resume from one


def parse_events(lines: list[str]) -> list[tuple[int | None, str]]:
    """(id, data) per event of raw SSE lines."""
    events, event_id = [], None
    for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            events.append((event_id, line[6:]))
            event_id = None
    return events


def text_of(events: list[tuple[int | None, str]]) -> str:
    chunks = [json.loads(data) for _, data in events if data != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_sdk_chat_and_completions(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.usage.completion_tokens == 6 and resp.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            n=2,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == 0)
    assert streamed == resp.choices[0].message.content
    text = client.completions.create(
        model=MODEL, prompt="The list", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert text.usage.completion_tokens == 5


def test_raw_sse_ids_and_headers(server):
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=stream_body(), headers=RESUMABLE) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        request_id = response.headers["x-request-id"]
        events = parse_events(list(response.iter_lines()))
    assert [i for i, _ in events] == list(range(1, len(events) + 1))
    assert events[-1][1] == "[DONE]"
    assert all(json.loads(d)["id"] == request_id for _, d in events[:-1])


def test_resume_with_last_event_id_gets_every_event_once(server):
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=stream_body(40), headers=RESUMABLE) as response:
        full = parse_events(list(response.iter_lines()))
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=stream_body(40), headers=RESUMABLE) as response:
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        first = []
        for line in lines:
            first += [line]
            if len(parse_events(first)) == 3:
                break
    seen = parse_events(first)
    resumed_response = httpx.get(
        f"{server}/v1/requests/{request_id}/stream", headers={"Last-Event-ID": str(seen[-1][0])}
    )
    assert resumed_response.status_code == 200
    resumed = parse_events(resumed_response.text.splitlines())
    ids = [i for i, _ in seen + resumed]
    assert ids == list(range(1, len(ids) + 1)), "an event was lost or repeated"
    assert text_of(seen + resumed) == text_of(full)


def test_cancel_frees_the_replica(server):
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=stream_body(400), headers=RESUMABLE) as response:
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        next(lines)
        cancelled = httpx.post(f"{server}/v1/requests/{request_id}/cancel").json()
        assert cancelled["cancelled"] is True
        assert metric(server, "tokenfleet_gateway_cancels_total", reason="api") >= 1
        rest = parse_events(list(lines))
    assert rest[-1][1] == "[DONE]"
    load = wait_idle(server)
    assert load["running"] == 0 and load["kv_usage"] == 0.0
    assert httpx.post(f"{server}/v1/requests/nope/cancel").status_code == 404


def test_disconnect_cancels_after_the_grace_period(server, client):
    abandoned = metric(server, "tokenfleet_gateway_cancels_total", reason="abandoned")
    aborted = metric(server, "vllm:request_success_total", finished_reason="abort")
    abandon_stream(client, MODEL, max_tokens=2000)  # seconds of work: far longer than the grace period
    load = wait_idle(server)
    assert load["running"] == 0 and load["kv_usage"] == 0.0
    assert metric(server, "tokenfleet_gateway_cancels_total", reason="abandoned") == abandoned + 1
    assert metric(server, "vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_bad_input_and_unknown_streams(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2100)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    assert httpx.get(f"{server}/v1/requests/nope/stream").status_code == 404
    bad = httpx.get(f"{server}/v1/requests/nope/stream", headers={"Last-Event-ID": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a forbidden topic"}])
    assert info.value.body["code"] == "content_filter"
    assert httpx.get(f"{server}/health").status_code == 200


def test_native_stream_format_and_resume(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me"}],
        "max_tokens": 9,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server}/v1/generate", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        request_id = response.headers["x-request-id"]
        raw = list(response.iter_lines())
    assert "event: done" in raw
    events = parse_events(raw)
    deltas = [json.loads(d) for _, d in events[:-1]]
    assert len(deltas) == 9 and all(set(d) >= {"delta", "index"} for d in deltas)
    usage = json.loads(events[-1][1])["usage"]
    assert usage["output_tokens"] == 9 and usage["input_tokens"] > 0 and "cached_tokens" in usage
    replay = httpx.get(f"{server}/v1/requests/{request_id}/stream", headers={"Last-Event-ID": "7"})
    assert [i for i, _ in parse_events(replay.text.splitlines())] == list(range(8, len(events) + 1))


def test_metrics_cover_gateway_and_replica(server):
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "tokenfleet_gateway_requests_total",
        "tokenfleet_gateway_stream_endings_total",
        "tokenfleet_gateway_active_relays",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        assert name in text, name
    assert 'endpoint="/v1/chat/completions",status="200"' in text


def test_the_model_list_is_open_without_auth(server, client):
    assert MODEL in {m.id for m in client.models.list()}
    assert httpx.get(f"{server}/v1/models").status_code == 200, "no key needed when the server runs open"


def test_the_fleet_file_sets_how_long_a_stream_can_be_resumed(demo_model_dir, tmp_path):
    """`resume_ttl_s` of `tokenfleet serve --config` applies to the embedded resume buffer."""
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"resume_ttl_s": 2}))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [
        "serve",
        "--model",
        str(demo_model_dir),
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--kv-cache-gib",
        "0.05",
        "--swap-space-gib",
        "0.01",
        "--max-model-len",
        "512",
        "--config",
        str(tmp_path / "fleet.yaml"),
        "--database-url",
        f"sqlite:///{tmp_path / 'serve.db'}",
    ]
    with running_process(args, f"{base}/health", tmp_path / "serve.log"):
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=stream_body(4), headers=RESUMABLE) as response:
            request_id = response.headers["x-request-id"]
            events = parse_events(list(response.iter_lines()))
        ended = time.monotonic()
        replay = httpx.get(f"{base}/v1/requests/{request_id}/stream", headers={"Last-Event-ID": "0"})
        assert replay.status_code == 200 and parse_events(replay.text.splitlines()) == events
        time.sleep(max(0.0, ended + 3.0 - time.monotonic()))
        expired = httpx.get(f"{base}/v1/requests/{request_id}/stream", headers={"Last-Event-ID": "0"})
        assert expired.status_code == 404, "a stream that ended 3 s ago is past its 2 s resume TTL"
