"""What the pages stand on, over HTTP against the same `tokenfleet serve --auth`: the pages and assets with their
security headers, a reply's stream resumed from Last-Event-ID (GET /v1/messages/{id}/stream) and its refusals,
the admin fleet view, and the static files shipped as package data."""

from __future__ import annotations

import fnmatch
import json
import tomllib
from pathlib import Path

import httpx
import pytest

from tests.web.conftest import ADMIN_KEY, LONG, PROMPT

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", ["/", "/chat", "/console"])
def test_pages_are_served_with_a_strict_content_security_policy(site, path):
    response = httpx.get(site.base + path)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy and "unsafe-eval" not in policy
    assert response.headers["x-content-type-options"] == "nosniff"
    assert '<script type="module" src="/web/js/' in response.text


def test_assets_are_served_and_nothing_outside_them(site):
    script = httpx.get(f"{site.base}/web/js/chat.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert script.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(f"{site.base}/web/style.css").headers["content-type"].startswith("text/css")
    for path in ("/web/../pages.py", "/web/%2e%2e/pages.py", "/web/nothing.js"):
        assert httpx.get(site.base + path).status_code == 404


def test_no_page_script_parses_markup_or_reaches_another_host():
    for script in (ROOT / "tokenfleet/web/static/js").glob("*.js"):
        text = script.read_text().replace('"http://www.w3.org/2000/svg"', "")  # SVG's namespace names no host
        for forbidden in (
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
            "http://",
            "https://",
        ):
            assert forbidden not in text, f"{script.name} uses {forbidden}"


def test_the_static_files_ship_as_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tokenfleet"]
    package = ROOT / "tokenfleet"
    static = [p.relative_to(package).as_posix() for p in (package / "web/static").rglob("*") if p.is_file()]
    assert static and all(any(fnmatch.fnmatch(path, pattern) for pattern in patterns) for path in static), static


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def events(lines):
    """(id, data) of each SSE event from a line iterator."""
    event_id, data = None, []
    for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            data.append(line[6:])
        elif not line and data:
            yield event_id, json.loads("\n".join(data))
            event_id, data = None, []


def test_a_reply_resumes_from_last_event_id_with_nothing_lost_or_repeated(site):
    reference = site.reference_reply()
    key = site.new_key()
    conversation = httpx.post(f"{site.base}/v1/conversations", json={}, headers=auth(key)).json()
    first: list[str] = []
    with httpx.stream(
        "POST",
        f"{site.base}/v1/conversations/{conversation['id']}/messages",
        json={"content": PROMPT, **LONG},
        headers=auth(key),
        timeout=60,
    ) as response:
        for event_id, event in events(response.iter_lines()):
            last_id = event_id
            if event["type"] == "start":
                message_id = event["messageId"]
            elif event["type"] == "token":
                first.append(event["text"])
                if len(first) == 20:
                    break  # hang up mid-reply, as a dropped connection does
    rest, ids = [], []
    with httpx.stream(
        "GET",
        f"{site.base}/v1/messages/{message_id}/stream",
        headers={**auth(key), "Last-Event-ID": str(last_id)},
        timeout=60,
    ) as response:
        assert response.status_code == 200 and response.headers["x-reply-prefix-length"] == "0"
        for event_id, event in events(response.iter_lines()):
            ids.append(event_id)
            if event["type"] == "token":
                rest.append(event["text"])
            elif event["type"] == "done":
                assert event["status"] == "complete"
    assert ids[0] == last_id + 1 and ids == list(range(ids[0], ids[0] + len(ids)))
    assert "".join(first + rest) == reference

    # over now: the saved message is where to read it
    gone = httpx.get(f"{site.base}/v1/messages/{message_id}/stream", headers=auth(key))
    assert gone.status_code == 409 and gone.json()["error"]["code"] == "reply_not_live"
    bad = httpx.get(f"{site.base}/v1/messages/{message_id}/stream", headers={**auth(key), "Last-Event-ID": "x1"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
    other = httpx.get(f"{site.base}/v1/messages/{message_id}/stream", headers=auth(site.new_key()))
    assert other.status_code == 404  # another user's message does not exist for them
    assert httpx.get(f"{site.base}/v1/messages/{message_id}/stream").status_code == 401


def test_the_fleet_view_is_for_the_admin_key_only(site):
    assert httpx.get(f"{site.base}/admin/v1/fleet").status_code == 401
    wrong = httpx.get(f"{site.base}/admin/v1/fleet", headers=auth(site.new_key()))
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_admin_key"
    fleet = httpx.get(f"{site.base}/admin/v1/fleet", headers=auth(ADMIN_KEY)).json()
    assert fleet["object"] == "fleet" and fleet["overload"]["level"] == 0
    (model,) = fleet["models"]
    (replica,) = model["replicas"]
    assert model["name"] == "tiny" and model["max_model_len"] == 2048
    assert replica["name"] == "local" and replica["healthy"] and replica["breaker"] == "closed"
    assert {tier["tier"] for tier in model["tiers"]} >= {"enterprise", "paid", "free", "batch"}
    assert fleet["autoscale"] == []  # autoscaling is off
