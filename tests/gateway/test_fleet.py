"""Gateway and replicas as separate processes, streams kept in the real Redis; drain on SIGTERM."""

from __future__ import annotations

import json
import signal
import time

import httpx
import openai
import redis
import yaml

from tests.gateway.conftest import MODEL, replica_args
from tests.gateway.test_serve import parse_events, stream_body, text_of
from tests.servers import free_port, metric, running_process


def test_sdk_through_the_gateway_spreads_over_replicas(fleet):
    client = openai.OpenAI(base_url=f"{fleet.base}/v1", api_key=fleet.keys["paid"], max_retries=0)
    streams = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Hi {i}"}],
            max_tokens=30,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for i in range(4)
    ]
    texts = ["".join(c.choices[0].delta.content or "" for c in s if c.choices) for s in streams]
    assert all(texts)
    served = [httpx.get(f"{r}/metrics").text for r in fleet.replicas]
    counts = [
        sum(float(line.split()[-1]) for line in m.splitlines() if line.startswith("vllm:request_success_total"))
        for m in served
    ]
    assert all(c >= 1 for c in counts), f"requests were not spread over the replicas: {counts}"
    reply = client.completions.create(
        model=MODEL, prompt="The list", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 4


def test_far_from_its_limits_a_tenant_is_decided_from_the_gateways_quota_leases(fleet):
    """The fleet gateway's quota is Redis with local leases (quota.local_leases, the default): a paid tenant's
    requests are decided in the gateway, and the lease's slots it holds are counted apart."""
    client = openai.OpenAI(base_url=f"{fleet.base}/v1", api_key=fleet.keys["paid"], max_retries=0)
    before = metric(fleet.base, "tokenfleet_quota_local_decisions_total")
    for i in range(3):
        reply = client.completions.create(model=MODEL, prompt=f"Count {i}", max_tokens=2, temperature=0)
        assert reply.usage.completion_tokens >= 1
    assert metric(fleet.base, "tokenfleet_quota_local_decisions_total") - before == 3
    assert metric(fleet.base, "tokenfleet_quota_leases") >= 2  # the organisation's and the user's
    assert metric(fleet.base, "tokenfleet_quota_lease_free_slots") >= 1


def test_resume_from_redis(fleet):
    with httpx.stream(
        "POST",
        f"{fleet.base}/v1/chat/completions",
        json=stream_body(60),
        headers={**fleet.auth("paid"), "x-tokenfleet-resumable": "true"},
    ) as response:
        request_id = response.headers["x-request-id"]
        first = []
        for line in response.iter_lines():
            first.append(line)
            if len(parse_events(first)) == 2:
                break
    seen = parse_events(first)
    assert redis.Redis(host="127.0.0.1", port=6379).exists(fleet.prefix + "stream:" + request_id)
    resumed = parse_events(
        httpx.get(
            f"{fleet.base}/v1/requests/{request_id}/stream",
            timeout=30,
            headers={"Last-Event-ID": str(seen[-1][0]), **fleet.auth("paid")},
        ).text.splitlines()
    )
    ids = [i for i, _ in seen + resumed]
    assert ids == list(range(1, len(ids) + 1)) and resumed[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in seen + resumed if d != "[DONE]"]
    assert sum(1 for c in chunks if c["choices"]) == 60


def test_replica_drains_on_sigterm(demo_model_dir, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with running_process(replica_args(demo_model_dir, port), f"{base}/health", tmp_path / "r.log") as proc:
        with httpx.stream(
            "POST",
            f"{base}/v1/chat/completions",
            json=stream_body(480),
            headers={"x-tokenfleet-resumable": "true"},
            timeout=60,
        ) as response:
            lines = response.iter_lines()
            first = [next(lines)]
            proc.send_signal(signal.SIGTERM)
            refused = refuses_new_connections(f"{base}/health")
            events = parse_events(first + list(lines))
        assert refused, "the draining replica still accepted a new connection"
        assert events[-1][1] == "[DONE]"
        assert len([e for e in events if e[1] != "[DONE]"]) == 480, "the in-flight stream was cut by the drain"
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
    assert text_of(events)


def refuses_new_connections(url: str, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=0.5)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    return False


def test_gateway_drains_on_sigterm(fleet, tmp_path):
    """A second gateway over the same fleet: SIGTERM stops new connections, the stream in flight runs to its end."""
    config = yaml.safe_load((fleet.log.parent / "fleet.yaml").read_text())
    port = free_port()
    config.update({"port": port, "drain_timeout_s": 20})
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(config))
    base = f"http://127.0.0.1:{port}"
    with running_process(
        ["gateway", "--config", str(tmp_path / "fleet.yaml")], f"{base}/health", tmp_path / "gateway.log"
    ) as proc:
        with httpx.stream(
            "POST",
            f"{base}/v1/chat/completions",
            json=stream_body(300),
            headers={**fleet.auth("paid"), "x-tokenfleet-resumable": "true"},
            timeout=60,
        ) as response:
            lines = response.iter_lines()
            first = [next(lines)]
            proc.send_signal(signal.SIGTERM)
            refused = refuses_new_connections(f"{base}/health")
            events = parse_events(first + list(lines))
        assert refused, "the draining gateway still accepted a new connection"
        assert events[-1][1] == "[DONE]" and len([e for e in events if e[1] != "[DONE]"]) >= 300
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)


def test_gateway_flags_override_the_files_host_and_port(fleet, tmp_path):
    """`tokenfleet gateway --config F --port P`: the same fleet file, another port, and it serves there."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = fleet.log.parent / "fleet.yaml"
    with running_process(
        ["gateway", "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
        f"{base}/health",
        tmp_path / "gateway.log",
    ):
        models = httpx.get(f"{base}/v1/models", headers=fleet.auth("paid"), timeout=10)
        assert models.status_code == 200
        assert yaml.safe_load(config.read_text())["port"] != port
