"""Disaggregated prefill/decode, end to end with real processes: a gateway in front of a prefill replica and decode
replicas. The client sees one ordinary stream whose greedy text is what a colocated replica gives; the KV blocks
really move (the replicas' transfer counters), the decode replica's next turn finds them in its prefix cache, and a
prefill or decode replica killed mid-request ends in a completed response with a `retrying` event, one usage row,
and no block held anywhere afterwards."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.gateway.conftest import ADMIN_KEY, MODEL, gateway_process, new_api_key, replica_args
from tests.gateway.test_serve import parse_events
from tests.router.test_fleet_routing import wait_for
from tests.servers import free_port, metric

TOPICS = ["the sea", "an old mill", "a red fox", "the clockmaker", "a harbour in winter"]


def long_prompt(topic: str, repeats: int = 12) -> str:
    return " ".join(f"Chapter {i}: tell me everything about {topic} and what happened next." for i in range(repeats))


@contextlib.contextmanager
def replica(model_dir: Path, port: int, role: str, logs: Path, *extra: str):
    args = [*replica_args(model_dir, port), "--role", role, "--max-model-len", "2048", *extra]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenfleet", *args],
        stdout=open(logs / f"{role}-{port}.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200, 120, proc)
        yield proc
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def disaggregated_fleet(model_dir: Path, logs: Path, roles: dict[str, list[str]], prefill_chunk: int = 2048):
    """Replica processes by role ({"prefill": [...names], "decode": [...], "both": [...]}; "both" ones stay out
    of the gateway's pools: references) and a gateway whose pools are the prefill and decode ones."""
    ports = {name: free_port() for names in roles.values() for name in names}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    gateway_port = free_port()
    config = {
        "port": gateway_port,
        "admin_key": ADMIN_KEY,
        "database_url": f"sqlite:///{logs / 'fleet.db'}",
        "models": [
            {
                "name": MODEL,
                "path": str(model_dir),
                "pools": [
                    {"name": "near", "role": role, "replicas": [urls[n] for n in roles.get(role, [])]}
                    for role in ("prefill", "decode")
                ],
            }
        ],
        "routing": {
            "replica_timeout_s": 10,
            "load_interval_s": 0.2,
            "max_retries": 2,
            "health": {"check_interval_s": 0.5, "check_timeout_s": 0.5},
        },
    }
    (logs / "fleet.yaml").write_text(yaml.safe_dump(config))
    with contextlib.ExitStack() as stack:
        procs = {}
        for role, names in roles.items():
            for name in names:
                extra = ("--max-num-batched-tokens", str(prefill_chunk)) if role == "prefill" else ()
                procs[name] = stack.enter_context(replica(model_dir, ports[name], role, logs, *extra))
        stack.enter_context(gateway_process(logs / "fleet.yaml", gateway_port, logs / "gateway.log"))
        base = f"http://127.0.0.1:{gateway_port}"
        key = new_api_key(base, "acme", "ann")
        yield {"base": base, "key": key, "urls": urls, "procs": procs, "db": logs / "fleet.db"}


def chat_stream(fleet, messages: list[dict], max_tokens: int, on_chunk=None) -> dict:
    """One greedy streamed chat completion through the gateway: text, usage, raw SSE lines, request id."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {fleet['key']}"}
    with httpx.stream("POST", f"{fleet['base']}/v1/chat/completions", json=body, timeout=120, headers=headers) as r:
        assert r.status_code == 200, r.read()
        raw = []
        for line in r.iter_lines():
            raw.append(line)
            if on_chunk is not None and line.startswith("data: "):
                on_chunk(len(parse_events(raw)))
        request_id = r.headers["x-request-id"]
    chunks = [json.loads(data) for _, data in parse_events(raw) if data != "[DONE]"]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert raw[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in raw
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
    return {"text": text, "usage": usage, "raw": raw, "request_id": request_id}


def retry_reasons(raw: list[str]) -> list[str]:
    events = [json.loads(data) for _, data in parse_events(raw) if data != "[DONE]"]
    return [e["retrying"]["reason"] for e in events if "retrying" in e]


def direct(url: str, messages: list[dict], max_tokens: int) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return reply.choices[0].message.content


def blocks(url: str, direction: str) -> float:
    return metric(url, "tokenfleet:kv_transfer_blocks_total", direction=direction, model_name=MODEL)


def idle_and_clean(url: str) -> None:
    """No request left and no block owned (imported blocks are free prefix-cache entries)."""
    wait_for(lambda: (load := httpx.get(f"{url}/load").json())["running"] == 0 and load["kv_usage"] == 0, 10)


def usage_rows(db: Path, request_id: str) -> list[tuple[int, int]]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with contextlib.closing(sqlite3.connect(db)) as conn:
            rows = conn.execute(
                "select input_tokens, output_tokens from usage_events where request_id = ?", (request_id,)
            ).fetchall()
        if rows:
            return rows
        time.sleep(0.2)
    return []


@pytest.fixture(scope="module")
def split_fleet(demo_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    roles = {"prefill": ["p"], "decode": ["d"], "both": ["colocated"]}
    with disaggregated_fleet(demo_model_dir, logs, roles, prefill_chunk=64) as fleet:
        yield fleet


def test_one_stream_like_a_colocated_replica_with_the_kv_moved(split_fleet):
    fleet, urls = split_fleet, split_fleet["urls"]
    sent, received = blocks(urls["p"], "sent"), blocks(urls["d"], "received")
    messages = [{"role": "user", "content": long_prompt("the sea")}]
    got = chat_stream(fleet, messages, 24)
    assert got["text"] == direct(urls["colocated"], messages, 24)
    moved = blocks(urls["p"], "sent") - sent
    assert moved >= 8, "the prompt's blocks did not go from the prefill to the decode replica"
    assert blocks(urls["d"], "received") - received == moved
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= moved * 16  # the decode side computed the tail
    assert retry_reasons(got["raw"]) == []
    assert usage_rows(fleet["db"], got["request_id"]) == [(got["usage"]["prompt_tokens"], 24)]
    for url in (urls["p"], urls["d"]):
        idle_and_clean(url)


def test_concurrent_streams_like_a_colocated_replica(split_fleet):
    fleet, urls = split_fleet, split_fleet["urls"]
    conversations = [[{"role": "user", "content": long_prompt(topic, 8 + i)}] for i, topic in enumerate(TOPICS)]
    with ThreadPoolExecutor(len(conversations)) as pool:
        got = list(pool.map(lambda m: chat_stream(fleet, m, 20), conversations))
    expected = [direct(urls["colocated"], m, 20) for m in conversations]
    assert [g["text"] for g in got] == expected
    assert all(g["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for g in got)
    for url in (urls["p"], urls["d"]):
        idle_and_clean(url)


def test_the_next_turn_hits_the_decode_replicas_prefix_cache(split_fleet):
    fleet, urls = split_fleet, split_fleet["urls"]
    first = [{"role": "user", "content": long_prompt("the clockmaker's daughter", 10)}]
    turn1 = chat_stream(fleet, first, 16)
    second = [*first, {"role": "assistant", "content": turn1["text"]}, {"role": "user", "content": "And then?"}]
    sent = blocks(urls["p"], "sent")
    turn2 = chat_stream(fleet, second, 16)
    cached1 = turn1["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached1 > 0
    assert blocks(urls["p"], "sent") == sent, "the second turn moved KV the decode replica already had"
    assert turn2["text"] == direct(urls["colocated"], second, 16)


def test_a_decode_replica_refuses_a_prefill_replicas_blocks_of_another_layout(split_fleet, demo_model_dir, tmp_path):
    """A prefill replica asked to prefill for a decode replica of another block size: a clear 409, nothing sent."""
    port = free_port()
    with replica(demo_model_dir, port, "prefill", tmp_path, "--block-size", "32"):
        response = httpx.post(
            f"http://127.0.0.1:{port}/internal/kv/prefill",
            json={"prompt": list(range(5, 200)), "peer": split_fleet["urls"]["d"]},
            timeout=30,
        )
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["code"] == "kv_layout_mismatch" and "block_size 32 here, 16 there" in error["message"]


def test_a_gateway_refuses_to_start_with_prefill_and_decode_replicas_of_different_layouts(demo_model_dir, tmp_path):
    ports = [free_port(), free_port()]
    with (
        replica(demo_model_dir, ports[0], "prefill", tmp_path, "--block-size", "32"),
        replica(demo_model_dir, ports[1], "decode", tmp_path),
    ):
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        config = {
            "port": free_port(),
            "admin_key": ADMIN_KEY,
            "database_url": f"sqlite:///{tmp_path / 'fleet.db'}",
            "models": [
                {
                    "name": MODEL,
                    "path": str(demo_model_dir),
                    "pools": [
                        {"name": "near", "role": "prefill", "replicas": [urls[0]]},
                        {"name": "near", "role": "decode", "replicas": [urls[1]]},
                    ],
                }
            ],
        }
        (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(config))
        done = subprocess.run(
            [sys.executable, "-m", "tokenfleet", "gateway", "--config", str(tmp_path / "fleet.yaml")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode != 0
    assert "KV layouts differ" in done.stderr and '"block_size": 32' in done.stderr


def test_replica_roles_that_cannot_move_blocks_fail_at_start(demo_model_dir, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenfleet",
            *replica_args(demo_model_dir, free_port()),
            "--role",
            "decode",
            "--no-enable-prefix-caching",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "--role decode" in done.stderr and "prefix caching" in done.stderr


# --- faults ---------------------------------------------------------------------------------------------------


def running_on(urls: list[str]) -> str:
    """The replica among these that has a request running now."""
    found: list[str] = []

    def check() -> bool:
        found[:] = [u for u in urls if httpx.get(f"{u}/load", timeout=1).json()["running"] > 0]
        return bool(found)

    wait_for(check, 30)
    return found[0]


class KillWhenBlocksArrive:
    """Watches these replicas (a thread each, polling their transfer counter), and once one of them has received KV
    blocks SIGKILLs `victim` (a name in the fleet; None: that receiving replica); `killed` says whom."""

    def __init__(self, fleet, urls: list[str], victim: str | None = None) -> None:
        self.fleet, self.victim, self.killed = fleet, victim, None
        self.done = threading.Event()
        names = {url: name for name, url in fleet["urls"].items()}
        self.threads = [
            threading.Thread(target=self._watch, args=(url, names[url], blocks(url, "received")), daemon=True)
            for url in urls
        ]
        for thread in self.threads:
            thread.start()

    def _watch(self, url: str, name: str, before: float) -> None:
        deadline = time.monotonic() + 60
        while not self.done.is_set() and time.monotonic() < deadline:
            if blocks(url, "received") > before:
                if not self.done.is_set():
                    self.done.set()
                    self.killed = self.victim or name
                    self.fleet["procs"][self.killed].send_signal(signal.SIGKILL)
                return
            time.sleep(0.001)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(70)


def test_prefill_or_decode_replica_killed_mid_request(demo_model_dir, tmp_path):
    roles = {"prefill": ["p"], "decode": ["d1", "d2", "d3"]}
    # the prefill replica computes 8 tokens a step: a long prompt's transfer (144 steps) lasts long enough to be cut
    # after the watcher sees its first blocks, even on a loaded machine (at 16 a step it once finished first)
    with disaggregated_fleet(demo_model_dir, tmp_path, roles, prefill_chunk=8) as fleet:
        urls = fleet["urls"]
        decoders = [urls["d1"], urls["d2"], urls["d3"]]

        # a decode replica killed mid-transfer: the prefill fails (not the prefill replica's fault), the stream
        # starts on another decode replica, prefilled by p again
        messages = [{"role": "user", "content": long_prompt("the miller's apprentice", 40)}]
        killer = KillWhenBlocksArrive(fleet, decoders)
        got = chat_stream(fleet, messages, 16)
        killer.join()
        assert killer.killed is not None
        assert retry_reasons(got["raw"]) == ["prefill_failed", "connect"]
        decoders.remove(urls[killer.killed])
        assert got["text"] == direct(decoders[0], messages, 16)
        assert usage_rows(fleet["db"], got["request_id"]) == [(got["usage"]["prompt_tokens"], 16)]
        for url in (urls["p"], *decoders):
            idle_and_clean(url)

        # a decode replica killed mid-stream: the rest comes from the other one (its prompt prefilled by p again)
        messages = [{"role": "user", "content": long_prompt("a lighthouse keeper", 6)}]
        killed: list[str] = []

        def kill_decoder(events: int) -> None:
            if events == 5 and not killed:
                killed.append(running_on(decoders))
                name = next(n for n, u in urls.items() if u == killed[0])
                fleet["procs"][name].send_signal(signal.SIGKILL)

        got = chat_stream(fleet, messages, 1000, on_chunk=kill_decoder)
        assert killed and retry_reasons(got["raw"]) == ["stream_broken"]
        survivor = next(u for u in decoders if u != killed[0])
        assert got["text"] == direct(survivor, messages, 1000)
        assert usage_rows(fleet["db"], got["request_id"]) == [(got["usage"]["prompt_tokens"], 1000)]
        for url in (urls["p"], survivor):
            idle_and_clean(url)

        # the prefill replica killed mid-transfer: the decode replica prefills itself
        messages = [{"role": "user", "content": long_prompt("the harbour master's ledger", 40)}]
        killer = KillWhenBlocksArrive(fleet, [survivor], victim="p")
        got = chat_stream(fleet, messages, 16)
        killer.join()
        assert killer.killed == "p"
        assert retry_reasons(got["raw"]) == ["prefill_failed"]
        assert metric(survivor, "tokenfleet:kv_transfers_failed_total", direction="received", model_name=MODEL) >= 1
        assert got["text"] == direct(survivor, messages, 16)
        assert usage_rows(fleet["db"], got["request_id"]) == [(got["usage"]["prompt_tokens"], 16)]
        idle_and_clean(survivor)
