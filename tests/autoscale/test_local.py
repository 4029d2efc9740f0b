"""The autoscaler in a real gateway process, driving the local orchestrator with real `tokenfleet replica`
processes that join through the Redis registry: the pool (min 1, max 2) grows under a load step sent with the
official openai SDK, the new replica takes traffic, and after the step the pool shrinks again — a replica drained
and stopped while a trickle of requests goes on — and no request fails."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml

from tests.gateway.conftest import ADMIN_KEY, MODEL
from tests.servers import delete_redis_keys, free_port, metric, running_process

REPLICA_ARGS = ["--kv-cache-gib", "0.05", "--swap-space-gib", "0.01", "--max-model-len", "512"]

DRAIN_TIMEOUT_S = 8


def fleet_config(model_dir, port: int, prefix: str, logs) -> dict:
    return {
        "model_name": MODEL,
        "model_path": str(model_dir),
        "port": port,
        "admin_key": ADMIN_KEY,
        "database_url": f"sqlite:///{logs / 'fleet.db'}",
        "redis_url": "redis://127.0.0.1:6379/0",
        "redis_prefix": prefix + "stream:",
        "quota": {"prefix": prefix + "quota:"},
        "metering": {"stream_key": prefix + "usage"},
        "dispatch": {"slots_per_replica": 4, "load_interval_s": 0.2},
        "routing": {
            "register_prefix": prefix + "replicas:",
            "load_interval_s": 0.2,
            "health": {"check_interval_s": 0.5},
        },
        "autoscale": {
            "enabled": True,
            "orchestrator": "local",
            "mode": "reactive",
            "interval_s": 0.5,
            "cold_start_s": 15,
            "scale_down_delay_s": 3,
            "cooldown_s": 2,
            "drain_settle_s": 1,
            # the gateway stops its replicas within drain + 5 s, inside the 20 s running_process gives it
            "local": {"drain_timeout_s": DRAIN_TIMEOUT_S, "log_dir": str(logs / "replicas")},
            "pools": {
                MODEL: {"min_replicas": 1, "max_replicas": 2, "target_in_flight": 2, "replica_args": REPLICA_ARGS}
            },
        },
    }


@pytest.fixture
def autoscaled(demo_model_dir, tmp_path):
    prefix, port = f"tokenfleet-test:{uuid.uuid4().hex}:", free_port()
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet_config(demo_model_dir, port, prefix, tmp_path)))
    base, seen = f"http://127.0.0.1:{port}", set()
    try:
        with running_process(
            ["gateway", "--config", str(tmp_path / "fleet.yaml")], f"{base}/health", tmp_path / "gateway.log"
        ) as gateway:
            yield {"base": base, "log": tmp_path / "gateway.log", "seen": seen, "pid": gateway.pid}
        for url in seen:  # the gateway stops the replicas it started when it stops (or they stop when it dies)
            assert gone_within(url, DRAIN_TIMEOUT_S + 5), f"replica {url} still serving after its gateway stopped"
    finally:
        delete_redis_keys(prefix)


def replicas(fleet) -> list[dict]:
    response = httpx.get(f"{fleet['base']}/admin/v1/replicas", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    found = response.json()["data"][MODEL]
    fleet["seen"].update(r["url"] for r in found)
    return found


def wait_until(check, timeout: float, what: str, fleet):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.2)
    metrics = [
        line
        for line in httpx.get(f"{fleet['base']}/metrics").text.splitlines()
        if line.startswith("tokenfleet_autoscale")
    ]
    raise AssertionError(
        f"{what} within {timeout}s; replicas {replicas(fleet)}; metrics:\n"
        + "\n".join(metrics)
        + f"\ngateway log:\n{fleet['log'].read_text()[-4000:]}"
    )


def gauge(fleet, name: str, **labels: str) -> float:
    return metric(fleet["base"], f"tokenfleet_autoscale_{name}", model=MODEL, pool="default", **labels)


def served(url: str) -> float:
    return metric(url, "vllm:request_success_total")


class Load:
    """Threads sending chat completions (streamed and not, alternately) until stopped; every outcome kept."""

    def __init__(self, client: openai.OpenAI, threads: int) -> None:
        self.client, self.stop = client, threading.Event()
        self.ok, self.failures = 0, []
        self.pool = ThreadPoolExecutor(threads)
        self.futures = [self.pool.submit(self._worker, i) for i in range(threads)]

    def _worker(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                self._one(stream=(i + n) % 2 == 0, topic=f"{i}-{n}")
                self.ok += 1
            except Exception as e:  # any failure at all is what the test is about
                self.failures.append(repr(e))

    def _one(self, stream: bool, topic: str) -> None:
        # each request its own prompt: with one shared prompt, cache-aware routing rightly keeps a handful of
        # requests on the replica that has it cached (the load bound's slack), and a new replica waits longer
        kwargs = dict(
            model=MODEL,
            messages=[{"role": "user", "content": f"{topic}: tell me a story"}],
            max_tokens=96,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        if not stream:
            response = self.client.chat.completions.create(**kwargs)
            assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 96
            return
        chunks = list(
            self.client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        )
        assert chunks[-1].usage.completion_tokens == 96, chunks[-1]
        assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)

    def finish(self) -> None:
        self.stop.set()
        for future in self.futures:
            future.result()
        self.pool.shutdown()


def test_a_load_step_grows_the_pool_and_it_shrinks_after_without_dropping_a_request(autoscaled):
    fleet = autoscaled
    first = wait_until(lambda: [r for r in replicas(fleet) if not r["draining"]], 90, "the min replica serving", fleet)[
        0
    ]
    key = httpx.post(
        f"{fleet['base']}/admin/v1/keys",
        json={"org": "acme", "user": "ann", "tier": "paid"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    ).json()["key"]
    client = openai.OpenAI(base_url=f"{fleet['base']}/v1", api_key=key, max_retries=0, timeout=60)
    assert gauge(fleet, "desired_replicas") == 1

    step = Load(client, threads=6)  # 6 in flight at 2 a replica: wants 3, max 2
    try:
        wait_until(lambda: gauge(fleet, "desired_replicas") == 2, 30, "desired 2 under the load step", fleet)
        second = wait_until(
            lambda: [r for r in replicas(fleet) if r["name"] != first["name"]], 90, "a second replica joining", fleet
        )[0]
        wait_until(lambda: served(second["url"]) >= 3, 30, "the second replica taking traffic", fleet)
    finally:
        step.finish()
    trickle = Load(client, threads=1)  # one at a time: the pool wants its minimum again
    try:
        wait_until(
            lambda: len(replicas(fleet)) == 1 and gauge(fleet, "ready_replicas") == 1,
            40,
            "the pool back to one replica",
            fleet,
        )
        time.sleep(1)  # requests keep going to the one left
    finally:
        trickle.finish()

    assert step.failures == [] and trickle.failures == [], (step.failures + trickle.failures)[:5]
    assert step.ok >= 12 and trickle.ok >= 3, (step.ok, trickle.ok)
    log = fleet["log"].read_text()
    (victim,) = {first["name"], second["name"]} - {r["name"] for r in replicas(fleet)}
    drained, stopped = log.index(f"drain ['{victim}']"), log.index(f"stopping replica {victim}")
    assert drained < stopped, "drained first, stopped once empty"
    victim_url = first["url"] if victim == first["name"] else second["url"]
    wait_until(lambda: _refuses(victim_url), 20, "the drained replica's process gone", fleet)
    assert gauge(fleet, "scale_events_total", direction="up") == 1
    assert gauge(fleet, "scale_events_total", direction="down") == 1


def gone_within(url: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not _refuses(url):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_killed_gateway_leaves_no_replica_serving(autoscaled):
    """SIGKILL, so no shutdown code runs: the replicas it started get SIGTERM from the kernel, drain and exit."""
    fleet = autoscaled
    (replica,) = wait_until(lambda: [r for r in replicas(fleet) if not r["draining"]], 90, "the min replica", fleet)
    assert httpx.get(f"{replica['url']}/health", timeout=5).status_code == 200
    os.kill(fleet["pid"], signal.SIGKILL)
    assert gone_within(replica["url"], DRAIN_TIMEOUT_S + 5), "the replica outlived its killed gateway"


def _refuses(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.HTTPError:
        return True
    return False
