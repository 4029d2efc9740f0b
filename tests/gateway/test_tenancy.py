"""Tenants through the public API, embedded and in a fleet: keys required, tenants isolated, quotas answered with
OpenAI's 429 and headers (which the SDK honours), the tier's priority passed on."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL, Platform
from tests.gateway.test_serve import parse_events, stream_body
from tests.servers import metric


def sdk(platform: Platform, who: str | None, retries: int = 0) -> openai.OpenAI:
    key = platform.keys[who] if who else "tf-not-a-real-key-000000000000000000000000000000"
    return openai.OpenAI(base_url=f"{platform.base}/v1", api_key=key, max_retries=retries)


def ask(client: openai.OpenAI, max_tokens: int = 4):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def test_every_public_endpoint_wants_a_valid_key(platform):
    assert ask(sdk(platform, "paid")).usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        ask(sdk(platform, None))
    for headers in (
        {},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer tf-unknown"},
    ):
        for method, path in (
            ("POST", "/v1/chat/completions"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/generate"),
            ("POST", "/v1/requests/chatcmpl-x/cancel"),
            ("GET", "/v1/requests/chatcmpl-x/stream"),
        ):
            response = httpx.request(method, platform.base + path, headers=headers, json=stream_body())
            assert response.status_code == 401, (path, headers, response.text)
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_the_model_list_wants_a_valid_key(platform):
    assert MODEL in {m.id for m in sdk(platform, "paid").models.list()}
    with pytest.raises(openai.AuthenticationError):
        sdk(platform, None).models.list()
    for headers in ({}, {"Authorization": "Bearer tf-unknown"}):
        response = httpx.get(f"{platform.base}/v1/models", headers=headers)
        assert response.status_code == 401, (headers, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_revoked_key_stops_working_at_once(platform):
    key = platform.new_key("short-lived", "sam", "paid")
    client = openai.OpenAI(base_url=f"{platform.base}/v1", api_key=key, max_retries=0)
    assert ask(client).choices[0].message.content is not None
    key_id = next(k["id"] for k in platform.admin("GET", "/keys", params={"org": "short-lived"}).json()["data"])
    assert platform.admin("DELETE", f"/keys/{key_id}").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        ask(client)


def test_admin_api_needs_the_admin_key(platform):
    assert httpx.get(f"{platform.base}/admin/v1/keys").status_code == 401
    assert httpx.get(f"{platform.base}/admin/v1/keys", headers=platform.auth("paid")).status_code == 401
    listed = platform.admin("GET", "/keys").json()["data"]
    assert listed and all("key" not in k and "hash" not in k for k in listed), "keys are shown only at creation"


def test_a_tenant_cannot_resume_or_cancel_another_tenants_request(platform):
    with httpx.stream(
        "POST",
        f"{platform.base}/v1/chat/completions",
        json=stream_body(200),
        headers={**platform.auth("paid"), "x-tokenfleet-resumable": "true"},
        timeout=30,
    ) as response:
        request_id, token = response.headers["x-request-id"], response.headers["x-resume-token"]
        lines = response.iter_lines()
        next(lines)
        for who in ("other", "free"):
            stranger = platform.auth(who)
            assert httpx.get(f"{platform.base}/v1/requests/{request_id}/stream", headers=stranger).status_code == 404
            cancel = httpx.post(f"{platform.base}/v1/requests/{request_id}/cancel", headers=stranger)
            assert cancel.status_code == 404 and request_id in cancel.json()["error"]["message"]
        forged = httpx.get(f"{platform.base}/v1/requests/{request_id}/stream", params={"resume_token": "0" * 64})
        assert forged.status_code == 404
        # the owner's resume token works without a key, as a browser's EventSource needs
        resumed = httpx.get(
            f"{platform.base}/v1/requests/{request_id}/stream",
            params={"resume_token": token, "last_event_id": "150"},
            timeout=30,
        )
        assert resumed.status_code == 200 and parse_events(resumed.text.splitlines())[0][0] == 151
        assert (
            httpx.post(f"{platform.base}/v1/requests/{request_id}/cancel", headers=platform.auth("paid")).json()[
                "cancelled"
            ]
            is False
        ), "it had finished already"


def test_over_a_limit_is_a_429_with_openai_headers_and_the_sdk_waits_it_out(platform):
    """Free users may run one request at a time: a second one is refused with retry-after, and the SDK, retrying
    by itself, gets through once the first has finished."""
    with httpx.stream(
        "POST", f"{platform.base}/v1/chat/completions", json=stream_body(450), headers=platform.auth("free"), timeout=30
    ) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        next(lines)
        refused = httpx.post(
            f"{platform.base}/v1/chat/completions",
            json={**stream_body(5), "stream": False},
            headers=platform.auth("free"),
        )
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        message = refused.json()["error"]["message"]
        assert "concurrent" in message and "user 'bob' of organisation 'hobby-" in message, "names, not bare ids"
        assert float(refused.headers["retry-after"]) >= 1 and int(refused.headers["retry-after-ms"]) > 0
        for name in ("limit-requests", "remaining-requests", "reset-requests", "limit-tokens", "remaining-tokens"):
            assert f"x-ratelimit-{name}" in refused.headers, name
        with pytest.raises(openai.RateLimitError):
            ask(sdk(platform, "free"))
        # the SDK retries after retry-after; meanwhile the first request ends
        result: list = []
        retrying = threading.Thread(target=lambda: result.append(ask(sdk(platform, "free", retries=5))))
        retrying.start()
        deadline = time.monotonic() + 5  # until the SDK's first try was refused (the first stream still runs)
        while (
            metric(platform.base, "tokenfleet_quota_refusals_total", tier="free", reason="concurrent_requests") < 3
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        list(lines)  # the first stream runs to its end
    retrying.join(timeout=60)
    assert result and result[0].usage.completion_tokens == 4, "the SDK's retry should have got through"
    assert metric(platform.base, "tokenfleet_quota_refusals_total", tier="free", reason="concurrent_requests") >= 3
    # other tenants were never limited by the free user's limit
    assert ask(sdk(platform, "paid")).usage.completion_tokens == 4


def test_successful_responses_carry_rate_limit_headers(platform):
    response = httpx.post(
        f"{platform.base}/v1/chat/completions", json={**stream_body(3), "stream": False}, headers=platform.auth("paid")
    )
    assert response.status_code == 200
    assert (
        int(response.headers["x-ratelimit-limit-requests"])
        >= int(response.headers["x-ratelimit-remaining-requests"])
        >= 0
    )
