"""`tokenfleet serve --auth` as a real process (SQLite given with --database-url): a reply streams, survives the
client hanging up, is saved mid-stream, stops on request; another user sees none of it; a gateway killed mid-reply
leaves the reply failed, not streaming forever, once it runs again."""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from tests.servers import free_port, running_process

ADMIN_KEY = "conversations-admin-key"
# saves every 0.2 s; a reply with no save for 1.5 s belongs to a dead gateway
SETTINGS = {"admin_key": ADMIN_KEY, "conversations": {"save_interval_s": 0.2, "stale_after_s": 1.5}}
# long enough to still be generating when the test looks, however fast the machine
LONG = {"max_tokens": 1900, "ignore_eos": True, "temperature": 0}


@contextmanager
def serving(model_dir, folder: Path, log_name: str = "serve.log"):
    (folder / "fleet.yaml").write_text(yaml.safe_dump(SETTINGS))
    port = free_port()
    args = [
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--kv-cache-gib",
        "0.05",
        "--swap-space-gib",
        "0.01",
        "--max-model-len",
        "2048",
        "--auth",
        "--config",
        str(folder / "fleet.yaml"),
        "--database-url",
        f"sqlite:///{folder / 'tokenfleet.db'}",
    ]
    with running_process(args, f"http://127.0.0.1:{port}/health", folder / log_name) as process:
        yield f"http://127.0.0.1:{port}", process


def new_key(base: str, org: str, user: str) -> dict[str, str]:
    response = httpx.post(
        f"{base}/admin/v1/keys",
        json={"org": org, "user": user, "tier": "paid"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert response.status_code == 201, response.text
    return {"Authorization": f"Bearer {response.json()['key']}"}


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    with serving(demo_model_dir, tmp_path_factory.mktemp("conversations")) as (base, _):
        yield base, new_key(base, "acme", "ann"), new_key(base, "rival", "eve")


def events_of(lines) -> iter:
    """(name, data) per event of a live SSE line iterator."""
    name, data = "message", []
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif not line and data:
            yield name, json.loads("\n".join(data))
            name, data = "message", []


def conversation(base: str, auth: dict) -> str:
    response = httpx.post(f"{base}/v1/conversations", json={"system_prompt": "Tell stories."}, headers=auth)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def until(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_a_reply_is_saved_mid_stream_and_finishes_after_the_client_hangs_up(server):
    base, ann, eve = server
    conv = conversation(base, ann)
    with httpx.stream(
        "POST", f"{base}/v1/conversations/{conv}/messages", json={"content": "Once", **LONG}, headers=ann, timeout=30
    ) as response:
        assert response.status_code == 200
        events = events_of(response.iter_lines())
        name, start = next(events)
        assert name == "start" and start["messageId"] == response.headers["x-message-id"]
        reply = start["messageId"]
        read = "".join(next(events)[1]["text"] for _ in range(5))
        partial = until(
            lambda: (m := httpx.get(f"{base}/v1/messages/{reply}", headers=ann).json())["tokens"] >= 5 and m
        )
        assert partial["status"] == "streaming" and partial["content"].startswith(read)
        for path in (f"/v1/messages/{reply}", f"/v1/conversations/{conv}", f"/v1/conversations/{conv}/messages"):
            assert httpx.get(base + path, headers=eve).status_code == 404
        assert httpx.post(f"{base}/v1/messages/{reply}/stop", headers=eve).status_code == 404
        assert httpx.get(f"{base}/v1/conversations", headers=eve).json()["data"] == []
    # the client hung up after 5 tokens; the reply goes on to its end and is saved
    final = until(
        lambda: (m := httpx.get(f"{base}/v1/messages/{reply}", headers=ann).json())["status"] != "streaming" and m,
        timeout=120,
    )
    assert (final["status"], final["tokens"], final["finish_reason"]) == ("complete", 1900, "length")
    assert final["content"].startswith(partial["content"]) and len(final["content"]) > len(partial["content"])
    listed = httpx.get(f"{base}/v1/conversations", headers=ann).json()["data"]
    assert listed[0]["id"] == conv and listed[0]["title"] == "Once"


def test_stop_ends_the_reply_with_its_text_so_far(server):
    base, ann, _ = server
    conv = conversation(base, ann)
    with httpx.stream(
        "POST", f"{base}/v1/conversations/{conv}/messages", json={"content": "Twice", **LONG}, headers=ann, timeout=30
    ) as response:
        events = events_of(response.iter_lines())
        reply = next(events)[1]["messageId"]
        streamed = "".join(next(events)[1]["text"] for _ in range(3))
        stopped = httpx.post(f"{base}/v1/messages/{reply}/stop", headers=ann)
        assert stopped.status_code == 200, stopped.text
        assert stopped.json()["status"] == "stopped" and stopped.json()["content"].startswith(streamed)
        rest = list(events)
    assert rest[-1][0] == "done" and rest[-1][1]["status"] == "stopped"
    assert streamed + "".join(d["text"] for n, d in rest if n == "token") == stopped.json()["content"]
    assert rest[-1][1]["usage"]["output"] == stopped.json()["tokens"] < 1900
    again = httpx.post(f"{base}/v1/messages/{reply}/stop", headers=ann)
    assert again.status_code == 409 and "not streaming" in again.json()["error"]["message"]
    until(lambda: httpx.get(f"{base}/load").json()["running"] == 0, timeout=5)
    assert httpx.get(f"{base}/load").json()["kv_usage"] == 0, "the stopped sequence's blocks are free"


def test_a_gateway_killed_mid_reply_leaves_it_failed_after_restart(demo_model_dir, tmp_path):
    with serving(demo_model_dir, tmp_path, "first.log") as (base, process):
        ann = new_key(base, "acme", "ann")
        conv = conversation(base, ann)
        with httpx.stream(
            "POST", f"{base}/v1/conversations/{conv}/messages", json={"content": "Go", **LONG}, headers=ann, timeout=30
        ) as response:
            reply = next(events_of(response.iter_lines()))[1]["messageId"]
            partial = until(lambda: (m := httpx.get(f"{base}/v1/messages/{reply}", headers=ann).json())["tokens"] and m)
            os.kill(process.pid, signal.SIGKILL)
    assert partial["status"] == "streaming"
    with serving(demo_model_dir, tmp_path, "second.log") as (base, _):
        time.sleep(1.6)  # past stale_after_s since the last save
        found = httpx.get(f"{base}/v1/messages/{reply}", headers=ann).json()
        assert found["status"] == "failed" and "regenerate" in found["error"]
        assert found["content"].startswith(partial["content"]), "the text saved before the crash is kept"
        with httpx.stream(
            "POST",
            f"{base}/v1/messages/{reply}/regenerate",
            json={"max_tokens": 8, "ignore_eos": True},
            headers=ann,
            timeout=30,
        ) as response:
            done = list(events_of(response.iter_lines()))[-1][1]
        assert (done["messageId"], done["status"], done["usage"]["output"]) == (reply, "complete", 8)
