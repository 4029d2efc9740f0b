"""A failover is invisible in the output: greedy streams whose replica is killed mid-response (the gateway continues
them on another replica, announced by a `retrying` event) produce exactly the text they produce without the fault.
The continuation starts from the token ids generated so far, not from the text re-tokenized."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from tests.gateway.conftest import ADMIN_KEY, MODEL, gateway_process, new_api_key, replica_args
from tests.gateway.test_serve import parse_events
from tests.router.test_fleet_routing import wait_for
from tests.servers import free_port

STREAMS = 8
MAX_TOKENS = 400


@pytest.fixture
def two_replicas(demo_model_dir, tmp_path):
    """Two replica processes and a fleet gateway in front of them."""
    ports, gateway_port = [free_port(), free_port()], free_port()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    config = {
        "port": gateway_port,
        "admin_key": ADMIN_KEY,
        "database_url": f"sqlite:///{tmp_path / 'fleet.db'}",
        "models": [{"name": MODEL, "path": str(demo_model_dir), "pools": [{"name": "near", "replicas": urls}]}],
        "dispatch": {"slots_per_replica": 2 * STREAMS},
        "routing": {
            "replica_timeout_s": 5,
            "load_interval_s": 0.2,
            "max_retries": 2,
            "health": {"check_interval_s": 0.5, "check_timeout_s": 0.5},
        },
    }
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(config))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tokenfleet", *replica_args(demo_model_dir, port)],
            stdout=open(tmp_path / f"r{i}.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        for i, port in enumerate(ports)
    ]
    try:
        for proc, url in zip(procs, urls):
            wait_for(lambda url=url: httpx.get(f"{url}/health", timeout=1).status_code == 200, 120, proc)
        with gateway_process(tmp_path / "fleet.yaml", gateway_port, tmp_path / "gateway.log"):
            base = f"http://127.0.0.1:{gateway_port}"
            key = new_api_key(base, "acme", "ann")
            yield {"base": base, "key": key, "urls": urls, "procs": procs}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def stream(fleet, content: str, started: threading.Barrier | None = None) -> tuple[str, list[str]]:
    """One greedy streamed chat completion through the gateway: its text and its raw SSE lines. With `started`,
    waits there once a few content events have come."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{fleet['base']}/v1/chat/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {fleet['key']}", "x-tokenfleet-resumable": "true"},
    ) as response:
        assert response.status_code == 200, response.read()
        raw = []
        for line in response.iter_lines():
            raw.append(line)
            if started is not None and line.startswith("data: ") and len(parse_events(raw)) == 3:
                started.wait(timeout=60)
    chunks = [json.loads(data) for _, data in parse_events(raw) if data != "[DONE]"]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert all("token_ids" not in choice for c in chunks for choice in c["choices"]), "internal: not for clients"
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), raw


def drain(fleet, url: str, draining: bool) -> None:
    response = httpx.post(
        f"{fleet['base']}/admin/v1/replicas/drain",
        json={"replica": url, "draining": draining},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert response.status_code == 200, response.text


def test_greedy_streams_are_the_same_with_a_replica_killed_mid_stream(two_replicas):
    fleet = two_replicas
    prompts = [
        f"Tell me story number {i} about the {word}"
        for i, word in enumerate(["sea", "old mill", "fox", "clockmaker", "harbour", "winter", "ledger", "kite"])
    ]
    with ThreadPoolExecutor(STREAMS) as pool:
        expected = [text for text, _ in pool.map(lambda p: stream(fleet, p), prompts)]

    drain(fleet, fleet["urls"][1], True)  # every stream starts on replica 0 ...
    started = threading.Barrier(STREAMS + 1)
    with ThreadPoolExecutor(STREAMS) as pool:
        results = pool.map(lambda p: stream(fleet, p, started), prompts)
        started.wait(timeout=60)
        drain(fleet, fleet["urls"][1], False)  # ... and continues on replica 1 once replica 0 dies
        fleet["procs"][0].send_signal(signal.SIGKILL)
        results = list(results)

    for (text, raw), want, prompt in zip(results, expected, prompts):
        assert "event: retrying" in raw, f"{prompt!r} finished before the replica died"
        same = next((i for i, (a, b) in enumerate(zip(text, want)) if a != b), min(len(text), len(want)))
        assert text == want, (
            f"{prompt!r} differs from character {same} on:\n{text[same : same + 80]!r}\n{want[same : same + 80]!r}"
        )
