"""The pages against a fleet (gateway and two replicas as processes; tenants in PostgreSQL, quotas and streams in
Redis): a free user over its request rate sees the 429 with a countdown, and the message goes once it ends; a
replica killed with SIGKILL shows as unhealthy in the console within a few seconds."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import ADMIN_KEY, running_fleet
from tests.web.conftest import FREE_RPM, last_reply, send, set_options, sign_in, wait_status, wait_until

SETTINGS = {
    "admin_key": ADMIN_KEY,
    "routing": {"health": {"check_interval_s": 0.5, "check_timeout_s": 0.5}},
    "tiers": {"free": {"priority": 1, "weight": 2, "user_limits": {"requests_per_minute": FREE_RPM}}},
}


def start_fleet(model_dir, tmp_path_factory):
    return running_fleet(model_dir, tmp_path_factory.mktemp("web-fleet"), SETTINGS)


@pytest.fixture(scope="module")
def fleet(fleet_in_background):
    """Started by tests/web/conftest.py at the start of the session, while the other tests run."""
    return fleet_in_background.get()


def test_a_free_user_over_its_rate_sees_a_countdown_and_the_message_goes_after_it(fleet, context):
    key = fleet.new_key("hobby", "bob", "free")
    page = context.new_page()
    sign_in(page, fleet.base, key)
    set_options(page, {"max_tokens": 4, "temperature": 0})
    for _ in range(FREE_RPM):  # the whole minute's requests, at once
        response = httpx.post(
            f"{fleet.base}/v1/completions",
            json={"model": "tiny", "prompt": "a", "max_tokens": 1},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
    send(page, "Am I too fast?")
    banner = page.locator("#banner")
    banner.get_by_text(re.compile(r"You've reached your rate limit\. Sending again in \d+ s\.")).wait_for()
    refused_at = time.monotonic()
    first = int(banner.get_attribute("data-retry-in"))
    assert 1 <= first <= 60 / FREE_RPM
    assert page.locator("li.message").count() == 0  # nothing was written for the refused message
    wait_until(lambda: int(banner.get_attribute("data-retry-in") or 0) < first, 3, "the countdown to go down")
    wait_status(page, "complete", timeout=30)
    assert time.monotonic() - refused_at >= first - 1.5
    assert banner.is_hidden()
    assert page.locator("li.message.user .text").text_content() == "Am I too fast?"
    assert last_reply(page).get_attribute("data-id")


def test_a_replica_killed_with_sigkill_shows_as_unhealthy_within_seconds(fleet, context):
    page = context.new_page()
    page.goto(f"{fleet.base}/console")
    page.get_by_label("Admin key").fill(ADMIN_KEY)
    page.get_by_role("button", name="Sign in").click()
    rows = [page.locator(f"tr[data-replica='{url}']") for url in fleet.replicas]
    for row in rows:
        row.wait_for()
        wait_until(lambda row=row: row.get_attribute("data-healthy") == "true", 10, "a healthy replica")
    page.get_by_text("2 / 2").wait_for()

    victim = fleet.replicas[0]
    os.kill(replica_pid(int(victim.rsplit(":", 1)[1])), signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: rows[0].get_attribute("data-healthy") == "false", 10, "the killed replica to show unhealthy")
    assert time.monotonic() - killed_at < 6
    assert rows[0].get_by_text("unhealthy", exact=True).is_visible()
    assert rows[1].get_attribute("data-healthy") == "true"
    page.get_by_text("1 / 2").wait_for()


def replica_pid(port: int) -> int:
    """The `tokenfleet replica --port PORT` process (the fleet helper keeps no handle on it)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"replica" in args and b"--port" in args and args[args.index(b"--port") + 1] == str(port).encode():
            return int(proc.name)
    raise AssertionError(f"no replica process on port {port}")
