"""Usage and billing end to end, embedded (SQLite, in-memory event log) and in a fleet (PostgreSQL, the Redis
Stream): requests through the openai SDK, then their usage through /v1/usage (own organisation only), the admin
usage and cost routes, and `tokenfleet usage`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL, PRICES, Platform


def usage(platform: Platform, key: str, **params) -> dict:
    response = httpx.get(
        f"{platform.base}/v1/usage", params=params, headers={"Authorization": f"Bearer {key}"}, timeout=10
    )
    assert response.status_code == 200, response.text
    return response.json()


def wait_for_requests(platform: Platform, key: str, count: int, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        report = usage(platform, key, group_by="org,user,model")
        if sum(line["requests"] for line in report["data"]) >= count or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def test_each_request_is_metered_and_priced_for_its_own_organisation_only(platform: Platform):
    org = f"meter-{uuid.uuid4().hex[:8]}"
    key = platform.new_key(org, "mia", "paid")
    client = openai.OpenAI(base_url=f"{platform.base}/v1", api_key=key, max_retries=0)
    answers = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Hi {i}"}],
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        for i in range(3)
    ]
    report = wait_for_requests(platform, key, 3)
    [line] = report["data"]
    assert line["requests"] == 3 and line["model"] == MODEL
    assert line["input_tokens"] == sum(a.usage.prompt_tokens for a in answers)
    assert line["output_tokens"] == sum(a.usage.completion_tokens for a in answers) == 15
    price = PRICES[MODEL]
    fresh = line["input_tokens"] - line["cached_tokens"]
    expected = (fresh * price["input"] + line["cached_tokens"] * price["cached_input"] + 15 * price["output"]) / 1e6
    assert line["cost_usd"] == pytest.approx(expected) and report["total_cost_usd"] == pytest.approx(expected)
    others = usage(platform, platform.keys["other"], group_by="org")
    assert all(row["org"] != line["org"] for row in others["data"]), "another organisation's usage leaked"

    admin = platform.admin("GET", "/usage", params={"org": line["org"], "group_by": "user,day"}).json()
    assert [(row["requests"], row["output_tokens"]) for row in admin["data"]] == [(3, 15)]
    costs = platform.admin("GET", "/usage/costs", params={"org": line["org"]}).json()
    [unit] = costs["data"]
    assert unit["tier"] == "paid" and unit["output_tokens"] == 15 and unit["engine_s"] > 0
    assert unit["cost_per_million_output_usd"] == pytest.approx(unit["engine_s"] * 3.6 / 3600 / 15 * 1e6)

    printed = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenfleet",
            "usage",
            "--database-url",
            platform.database_url,
            "--org",
            org,
            "--by",
            "org,model",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert printed.returncode == 0, printed.stderr
    [row] = json.loads(printed.stdout)
    assert (row["org"], row["requests"], row["output_tokens"]) == (line["org"], 3, 15)
    assert row["org_name"] == org, "a report names the organisation beside its id"
    table = subprocess.run(
        [sys.executable, "-m", "tokenfleet", "usage", "--database-url", platform.database_url, "--by", "org,user"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert table.returncode == 0, table.stderr
    assert f"{org} ({line['org']})" in table.stdout and "mia (" in table.stdout, table.stdout


def test_usage_rejects_bad_parameters_in_the_openai_error_shape(platform: Platform):
    key = platform.keys["paid"]
    for params in ({"group_by": "planet"}, {"since": "yesterday"}):
        response = httpx.get(f"{platform.base}/v1/usage", params=params, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 400 and response.json()["error"]["param"] in ("group_by", "since")
    assert httpx.get(f"{platform.base}/v1/usage").status_code == 401
    assert httpx.get(f"{platform.base}/admin/v1/usage", headers={"Authorization": f"Bearer {key}"}).status_code in (
        401,
        403,
    )
