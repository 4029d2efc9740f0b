"""`kill -9` of a fleet gateway mid-stream, then a restart: the request is billed for at least what its client
received (not the last checkpoint's counts), with its prompt; and a client resuming the stream on the restarted
gateway gets what it missed, then an error saying the generation was lost, then [DONE], instead of pings until the
stream expires."""

from __future__ import annotations

import json
import time

import httpx

from tests.chaos.harness import (
    Outcome,
    chaos_fleet,
    chat_body,
    check_metered,
    check_no_relay_left,
    outbox_event,
    read_events,
)

# few checkpoints of the request's counts before the kill: most of what it delivered is after the last one
METERING = {"lease_s": 3.0, "checkpoint_s": 2.5}
STREAMS = {"owner_lease_s": 2.0, "ping_interval_s": 1.0}


def test_a_request_whose_gateway_was_killed_is_billed_for_what_was_generated(demo_model_dir, tmp_path):
    with chaos_fleet(demo_model_dir, tmp_path, metering=METERING, streams=STREAMS) as fleet:
        with fleet.gateway() as process:
            key = fleet.new_key()
            killed, opened_with = read_then_kill(fleet, key, process, read_s=1.0)
        assert killed.delivered > 0, killed.describe()
        assert opened_with["input_tokens"] > 0, "the open row does not bill the prompt counted at admission"
        with fleet.gateway():
            resumed = resume_until_it_ends(fleet.base, key, killed, within_s=15.0)
            [row] = check_metered(fleet, [killed]).values()
            check_no_relay_left(fleet)
    assert row.status == "failed"
    ids = [event_id for event_id, _, _ in killed.events + resumed.events]
    assert ids == list(range(1, len(ids) + 1)), "the resume skipped or repeated events"
    *_, (_, _, error), (_, _, done) = resumed.events
    assert "lost" in json.loads(error)["error"]["message"] and done == "[DONE]", resumed.describe()


def read_then_kill(fleet, key: str, process, read_s: float) -> tuple[Outcome, dict]:
    """Reads a long stream for `read_s`, then SIGKILLs the gateway. Returns what the client got until then, and
    the request's outbox event as it was opened (read as soon as it exists, before any checkpoint of its counts)."""
    outcome = Outcome()
    with httpx.stream(
        "POST",
        f"{fleet.base}/v1/chat/completions",
        json=chat_body(1500),
        timeout=30,
        headers={"Authorization": f"Bearer {key}", "x-tokenfleet-resumable": "true"},
    ) as response:
        assert response.status_code == 200, response.read()
        outcome.status, outcome.headers = 200, dict(response.headers)
        opened = _wait_for_open_row(fleet, outcome.request_id)
        read_events(response, outcome, deadline=time.monotonic() + read_s)
        process.kill()
        process.wait()
    return outcome, opened


def _wait_for_open_row(fleet, request_id: str) -> dict:
    deadline = time.monotonic() + 2.0
    while (event := outbox_event(fleet, request_id)) is None:
        assert time.monotonic() < deadline, "no outbox row for a running request"
        time.sleep(0.01)
    return event


def resume_until_it_ends(base: str, key: str, killed: Outcome, within_s: float) -> Outcome:
    outcome = Outcome()
    last_id = killed.events[-1][0]
    with httpx.stream(
        "GET",
        f"{base}/v1/requests/{killed.request_id}/stream",
        timeout=10,
        headers={"Authorization": f"Bearer {key}", "Last-Event-ID": str(last_id)},
    ) as response:
        assert response.status_code == 200, response.read()
        ended = read_events(response, outcome, deadline=time.monotonic() + within_s)
    assert ended, f"the resumed stream did not end within {within_s} s: {outcome.describe()}"
    return outcome
