"""Ejected replicas with real processes behind a fleet gateway: a replica that comes up after the gateway is let in
by its first passing health check (not after its growing ejection time), and when no replica of a model is healthy
the ejected ones are tried before a request fails (Envoy's panic mode)."""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager

import httpx
import openai
import yaml

from tests.gateway.conftest import ADMIN_KEY, MODEL, gateway_process, new_api_key, replica_args
from tests.router.test_fleet_routing import wait_for
from tests.servers import free_port, running_process


@contextmanager
def gateway_before_its_late_replica(model_dir, tmp_path, health: dict):
    """A fleet gateway over two replicas of which only the first runs; the second is the caller's to start."""
    ports, gateway_port = [free_port(), free_port()], free_port()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    config = {
        "port": gateway_port,
        "admin_key": ADMIN_KEY,
        "database_url": f"sqlite:///{tmp_path / 'fleet.db'}",
        "models": [{"name": MODEL, "path": str(model_dir), "pools": [{"name": "near", "replicas": urls}]}],
        "routing": {"replica_timeout_s": 5, "load_interval_s": 0.2, "max_retries": 2, "health": health},
    }
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(config))
    with (
        running_process(replica_args(model_dir, ports[0]), f"{urls[0]}/health", tmp_path / "first.log") as first,
        gateway_process(tmp_path / "fleet.yaml", gateway_port, tmp_path / "gateway.log"),
    ):
        base = f"http://127.0.0.1:{gateway_port}"
        key = new_api_key(base, "acme", "ann")
        wait_for(lambda: health_of(base, urls[1]) == "ejected", 30)  # the late replica is down: ejected
        yield {"base": base, "key": key, "first": first, "late_port": ports[1], "late_url": urls[1]}


def health_of(base: str, replica: str) -> str:
    replicas = httpx.get(f"{base}/admin/v1/replicas", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    return next(r["health"] for r in replicas["data"][MODEL] if r["name"] == replica)


def ask_streaming(fleet) -> str:
    client = openai.OpenAI(base_url=f"{fleet['base']}/v1", api_key=fleet["key"], max_retries=0)
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_replica_that_comes_up_late_is_readmitted_by_its_first_passing_check(demo_model_dir, tmp_path):
    """It was kept out for its whole ejection time (growing 5 -> 25 s while it started), and when the others died
    every stream failed with "no healthy replica" while it sat healthy and idle."""
    health = {"check_interval_s": 0.5, "check_timeout_s": 0.5, "base_ejection_s": 60}
    with gateway_before_its_late_replica(demo_model_dir, tmp_path, health) as fleet:
        with running_process(
            replica_args(demo_model_dir, fleet["late_port"]), f"{fleet['late_url']}/health", tmp_path / "late.log"
        ):
            healthy_at = time.monotonic()
            wait_for(lambda: health_of(fleet["base"], fleet["late_url"]) == "healthy", 5)
            assert time.monotonic() - healthy_at < 5
            fleet["first"].send_signal(signal.SIGKILL)
            fleet["first"].wait()
            for _ in range(4):
                assert ask_streaming(fleet), "served by the late replica"


def test_with_no_healthy_replica_left_an_ejected_one_is_tried(demo_model_dir, tmp_path):
    """The late replica stays ejected (one health check round only, a long ejection); the first one dies. The pool's
    ejection cap keeps the dead one "healthy", a request fails on it, and its retry has only the ejected one left."""
    health = {"check_interval_s": 3600, "check_timeout_s": 0.5, "consecutive_failures": 1, "base_ejection_s": 600}
    with gateway_before_its_late_replica(demo_model_dir, tmp_path, health) as fleet:
        with running_process(
            replica_args(demo_model_dir, fleet["late_port"]), f"{fleet['late_url']}/health", tmp_path / "late.log"
        ):
            fleet["first"].send_signal(signal.SIGKILL)
            fleet["first"].wait()
            for _ in range(4):
                assert ask_streaming(fleet), "served by the ejected replica rather than failing"
            assert health_of(fleet["base"], fleet["late_url"]) == "ejected", "no check has readmitted it"


def test_ready_turns_false_when_the_last_replica_dies_while_health_stays_true(demo_model_dir, tmp_path):
    health = {"check_interval_s": 0.5, "check_timeout_s": 0.5, "base_ejection_s": 60}
    with gateway_before_its_late_replica(demo_model_dir, tmp_path, health) as fleet:
        ready = httpx.get(f"{fleet['base']}/ready", timeout=5)
        assert ready.status_code == 200 and ready.json()["replicas"] == {MODEL: 1}
        fleet["first"].send_signal(signal.SIGKILL)
        fleet["first"].wait()
        wait_for(lambda: httpx.get(f"{fleet['base']}/ready", timeout=5).status_code == 503, 15)
        not_ready = httpx.get(f"{fleet['base']}/ready", timeout=5).json()
        assert not_ready["status"] == "not_ready" and not_ready["error"]["code"] == "no_replica"
        assert httpx.get(f"{fleet['base']}/health", timeout=5).status_code == 200, "the process itself is alive"
