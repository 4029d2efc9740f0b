"""The router with real replica processes behind one gateway process: a replica killed or hung mid-stream (the
response continues elsewhere, announced by a `retrying` event, metered once), drain, canary split, versions and
aliases, deprecation, a conversation's turns finding their replica's prefix cache, and bad fleet files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml

from tests.gateway.conftest import ADMIN_KEY, gateway_process, new_api_key, replica_args
from tests.gateway.test_serve import parse_events
from tests.servers import delete_redis_keys, free_port, metric, running_process

V1, V2, OLD = "tiny-2026-10-01", "tiny-2026-11-01", "tiny-2026-01-01"


def fleet_file(model_dir, ports: list[int], gateway_port: int, path) -> dict:
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    config = {
        "port": gateway_port,
        "admin_key": ADMIN_KEY,
        "database_url": f"sqlite:///{path.parent / 'fleet.db'}",
        "models": [
            {
                "name": V1,
                "path": str(model_dir),
                "aliases": ["tiny"],
                "pools": [{"name": "near", "latency_ms": 1, "replicas": urls[:2]}],
            },
            {"name": V2, "path": str(model_dir), "pools": [{"name": "near", "replicas": urls[2:]}]},
            {
                "name": OLD,
                "path": str(model_dir),
                "deprecated_on": "2026-06-01",
                "pools": [{"name": "near", "replicas": urls[2:]}],
            },
        ],
        "routing": {
            "replica_timeout_s": 3,
            "load_interval_s": 0.2,
            "max_retries": 2,
            "health": {"check_interval_s": 0.5, "check_timeout_s": 0.5, "base_ejection_s": 3},
            "canary": [{"model": "tiny", "version": V2, "percent": {"default": 20}}],
        },
    }
    path.write_text(yaml.safe_dump(config))
    return config


@pytest.fixture(scope="module")
def fleet(demo_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("routing")
    ports, gateway_port = [free_port() for _ in range(3)], free_port()
    names = [V1, V1, V2]
    fleet_file(demo_model_dir, ports, gateway_port, logs / "fleet.yaml")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tokenfleet", *replica_args(demo_model_dir, p)[:-2], "--served-model-name", n],
            stdout=open(logs / f"r{i}.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        for i, (p, n) in enumerate(zip(ports, names))
    ]
    for proc, port in zip(procs, ports):
        wait_for(
            lambda port=port: httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200, 120, proc
        )
    with gateway_process(logs / "fleet.yaml", gateway_port, logs / "gateway.log"):
        base = f"http://127.0.0.1:{gateway_port}"
        key = new_api_key(base, "acme", "ann")
        yield {
            "base": base,
            "key": key,
            "replicas": [f"http://127.0.0.1:{p}" for p in ports],
            "procs": procs,
            "log": logs / "gateway.log",
        }
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait()


def wait_for(check, timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"replica exited with {proc.returncode}")
        try:
            if check():
                return
        except (httpx.HTTPError, openai.APIError):
            pass
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def body(model: str, max_tokens: int, content: str = "Tell me a story", **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def sdk(model: str, max_tokens: int) -> dict:
    """body() as keyword arguments of the openai SDK (vLLM's ignore_eos goes in extra_body)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }


def serving(fleet, among: range) -> int:
    """Which replica (index) is running a request now."""
    for i in among:
        try:
            if httpx.get(f"{fleet['replicas'][i]}/load", timeout=1).json()["running"]:
                return i
        except httpx.HTTPError:
            continue
    raise AssertionError("no replica is running the request")


def stream_until_killed(fleet, stop_replica) -> tuple[list, dict]:
    """Streams a long response, stops the replica serving it after a few events, reads on to the end."""
    headers = {"Authorization": f"Bearer {fleet['key']}", "x-tokenfleet-resumable": "true"}
    with httpx.stream(
        "POST",
        f"{fleet['base']}/v1/chat/completions",
        headers=headers,
        timeout=60,
        json=body(V1, 300, stream=True, stream_options={"include_usage": True}),
    ) as response:
        lines, events, victim = response.iter_lines(), [], None
        raw = []
        for line in lines:
            raw.append(line)
            if len(parse_events(raw)) == 5 and victim is None:
                victim = serving(fleet, range(2))
                stop_replica(fleet["procs"][victim])
        events = parse_events(raw)
    return events, {"victim": victim, "raw": raw}


def check_continued(events: list, raw: list) -> None:
    assert "event: retrying" in raw, "the client was told the response moved"
    ids = [i for i, _ in events]
    assert ids == list(range(1, len(ids) + 1)), "ids stay gapless across the retry"
    chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
    content = [c for c in chunks if c.get("choices")]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    usage = [c["usage"] for c in chunks if c.get("usage") and not c.get("choices")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == 300, "metered once, for the whole response"
    assert events[-1][1] == "[DONE]"


def wait_all_healthy(fleet) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def healthy() -> bool:
        replicas = httpx.get(f"{fleet['base']}/admin/v1/replicas", headers=admin).json()["data"][V1]
        return all(r["health"] == "healthy" for r in replicas)

    wait_for(healthy, 30)


def test_a_hung_replica_mid_stream_hands_the_response_to_another(fleet):
    """SIGSTOP: the replica neither answers nor closes. After replica_timeout_s the attempt fails and the
    response continues on the other replica; once resumed (SIGCONT) the replica is probed back into service."""
    stopped = []
    events, seen = stream_until_killed(fleet, lambda proc: (proc.send_signal(signal.SIGSTOP), stopped.append(proc)))
    for proc in stopped:
        proc.send_signal(signal.SIGCONT)
    check_continued(events, seen["raw"])
    wait_all_healthy(fleet)


def test_a_replica_killed_mid_stream_hands_the_response_to_another(fleet):
    wait_all_healthy(fleet)
    events, seen = stream_until_killed(fleet, lambda proc: proc.send_signal(signal.SIGKILL))
    check_continued(events, seen["raw"])
    # the dead replica is ejected; new requests keep working on the survivor
    client = openai.OpenAI(base_url=f"{fleet['base']}/v1", api_key=fleet["key"], max_retries=0)
    for _ in range(3):
        assert client.chat.completions.create(**sdk(V1, 4)).usage.completion_tokens == 4


def test_canary_takes_its_share_and_pinned_versions_stay(fleet):
    headers = {"Authorization": f"Bearer {fleet['key']}"}

    def model_of(request_body: dict) -> str:
        response = httpx.post(f"{fleet['base']}/v1/chat/completions", json=request_body, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        return response.headers["x-tokenfleet-model"]

    with ThreadPoolExecutor(8) as pool:
        served = Counter(pool.map(lambda i: model_of(body("tiny", 1, f"q{i}")), range(300)))
        pinned = Counter(pool.map(lambda i: model_of(body(V1, 1, f"p{i}")), range(40)))
    share = served[V2] / 300
    assert abs(share - 0.20) < 0.07, served  # 3 standard deviations of 300 draws
    assert pinned == {V1: 40}, "a request naming a version gets that version"


def test_versions_aliases_and_deprecation(fleet):
    client = openai.OpenAI(base_url=f"{fleet['base']}/v1", api_key=fleet["key"], max_retries=0)
    listed = {m.id for m in client.models.list()}
    assert {V1, V2, "tiny"} <= listed
    with pytest.raises(openai.NotFoundError) as gone:
        client.chat.completions.create(**sdk(OLD, 2))
    assert "deprecated" in str(gone.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(**sdk("tiny-1999", 2))


def test_a_conversation_finds_its_replica_cache_again(fleet):
    headers = {"Authorization": f"Bearer {fleet['key']}", "x-conversation-id": "conv-42"}
    history = [{"role": "system", "content": "You are a patient assistant. " * 8}]
    cached = []
    for turn in range(4):
        history.append({"role": "user", "content": f"Question number {turn}: tell me more about item {turn}."})
        response = httpx.post(
            f"{fleet['base']}/v1/chat/completions",
            headers=headers,
            timeout=30,
            json={"model": V2, "messages": history, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        )
        assert response.status_code == 200, response.text
        reply = response.json()
        cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    assert all(c > 0 for c in cached[1:]), f"later turns should hit the prefix cache: {cached}"


def test_drain_lets_streams_finish_and_sends_new_work_elsewhere(fleet):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    target = fleet["replicas"][2]
    headers = {"Authorization": f"Bearer {fleet['key']}", "x-tokenfleet-resumable": "true"}
    with httpx.stream(
        "POST", f"{fleet['base']}/v1/chat/completions", headers=headers, timeout=60, json=body(V2, 200, stream=True)
    ) as response:
        lines = response.iter_lines()
        first = [next(lines)]
        drained = httpx.post(
            f"{fleet['base']}/admin/v1/replicas/drain", headers=admin, json={"replica": target, "draining": True}
        )
        assert drained.status_code == 200, drained.text
        events = parse_events(first + list(lines))
    assert events[-1][1] == "[DONE]" and len(events) == 201, "the in-flight stream finished on the draining replica"
    refused = httpx.post(f"{fleet['base']}/v1/chat/completions", headers=headers, json=body(V2, 2), timeout=30)
    assert refused.status_code == 503, "V2 has no other replica: new work is refused, not sent to the drainer"
    httpx.post(f"{fleet['base']}/admin/v1/replicas/drain", headers=admin, json={"replica": target, "draining": False})
    assert (
        httpx.post(f"{fleet['base']}/v1/chat/completions", headers=headers, json=body(V2, 2), timeout=30).status_code
        == 200
    )
    assert "replica http://127.0.0.1" in fleet["log"].read_text() and "draining" in fleet["log"].read_text()


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"routing": {"canary": [{"model": "tiny", "version": "nope", "percent": {"default": 5}}]}},
            "canary names an unknown model",
        ),
        ({"models": [{"name": "m", "path": "/nonexistent"}]}, "no checkpoint"),
        ({"models": [{"name": "m", "path": "/x", "pools": [{"replicas": ["localhost:9"]}]}]}, "is not an http"),
        ({"routing": {"policy": "random"}}, "policy must be one of"),
    ],
)
def test_bad_fleet_files_are_clear_start_up_errors(demo_model_dir, tmp_path, change, message):
    config = fleet_file(demo_model_dir, [free_port()] * 3, free_port(), tmp_path / "fleet.yaml")
    config.update(change)
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [sys.executable, "-m", "tokenfleet", "gateway", "--config", str(tmp_path / "fleet.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, "a configuration mistake is a message, not a crash"


def test_an_unreachable_replica_is_ejected_and_the_gateway_keeps_serving(demo_model_dir, tmp_path):
    live, dead, gateway_port = free_port(), free_port(), free_port()
    config = fleet_file(demo_model_dir, [live, dead, live], gateway_port, tmp_path / "fleet.yaml")
    config["routing"]["canary"] = []
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(config))
    with (
        running_process(
            replica_args(demo_model_dir, live)[:-2] + ["--served-model-name", V1],
            f"http://127.0.0.1:{live}/health",
            tmp_path / "live.log",
        ),
        gateway_process(tmp_path / "fleet.yaml", gateway_port, tmp_path / "gateway.log"),
    ):
        base = f"http://127.0.0.1:{gateway_port}"
        key = new_api_key(base, "a", "b")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        for _ in range(6):
            assert client.chat.completions.create(**sdk(V1, 2)).usage.completion_tokens == 2
        wait_for(lambda: "open" in (tmp_path / "gateway.log").read_text(), 10)
        assert metric(base, "tokenfleet_gateway_requests_total", status="200") >= 6


def test_replicas_join_and_leave_a_running_fleet_through_redis(demo_model_dir, tmp_path):
    """No replica in the fleet file: one registers itself in Redis and takes traffic; killed, it leaves."""
    import uuid

    prefix = f"tftest:routing:{uuid.uuid4().hex}:"
    gateway_port, port = free_port(), free_port()
    config = fleet_file(demo_model_dir, [], gateway_port, tmp_path / "fleet.yaml")
    config["models"] = [{"name": V1, "path": str(demo_model_dir), "pools": [{"name": "near"}]}]
    config["routing"] = {"register_prefix": prefix + "replicas:", "canary": []}
    config.update(
        {
            "redis_url": "redis://127.0.0.1:6379/0",
            "redis_prefix": prefix + "stream:",
            "quota": {"prefix": prefix + "quota:"},
        }
    )
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(config))
    replica = replica_args(demo_model_dir, port)[:-2] + [
        "--served-model-name",
        V1,
        "--register",
        "redis://127.0.0.1:6379/0",
        "--registry-prefix",
        prefix + "replicas:",
        "--registry-ttl",
        "1",
        "--pool",
        "near",
    ]
    try:
        with gateway_process(tmp_path / "fleet.yaml", gateway_port, tmp_path / "gateway.log"):
            base = f"http://127.0.0.1:{gateway_port}"
            key = new_api_key(base, "a", "b")
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.APIStatusError) as empty:
                client.chat.completions.create(**sdk(V1, 2))
            assert empty.value.status_code == 503, "no replica yet: a clear 503"
            with running_process(replica, f"http://127.0.0.1:{port}/health", tmp_path / "replica.log") as proc:
                wait_for(lambda: client.chat.completions.create(**sdk(V1, 2)).usage.completion_tokens == 2, 30)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            wait_for(lambda: "left" in (tmp_path / "gateway.log").read_text(), 10)
            with pytest.raises(openai.APIStatusError):
                client.chat.completions.create(**sdk(V1, 2))
    finally:
        delete_redis_keys(prefix)
