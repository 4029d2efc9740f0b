"""The Responses API through the official SDK against `tokenfleet serve --auth`: text in and out, whole and
streamed (the SDK assembles the typed events into the same response), stored responses read back and deleted,
previous_response_id chains, cancel, one tenant never reaching another's responses, and a parameter we do not
serve refused by name."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL


@pytest.fixture
def client(embedded) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embedded.base}/v1", api_key=embedded.keys["paid"], max_retries=0)


def test_a_response_whole_and_streamed_is_the_same_text(client):
    whole = client.responses.create(model=MODEL, input="Tell me", max_output_tokens=12, temperature=0)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == MODEL
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.output_tokens <= 12 and whole.usage.input_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    with client.responses.stream(model=MODEL, input="Tell me", max_output_tokens=12, temperature=0) as stream:
        events = list(stream)
    types, final = [event.type for event in events], events[-1].response  # the SDK's final response wants a
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if final.status == "completed" else "response.incomplete",
    ]
    assert "response.output_text.delta" in types  # response.completed; one cut at max_output_tokens is incomplete
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert final.output_text == whole.output_text == deltas
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stored_responses_chain_read_back_and_delete(client):
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=6, temperature=0)
    second = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=6, temperature=0
    )
    alone = client.responses.create(model=MODEL, input="And then?", max_output_tokens=6, temperature=0)
    # the chain's prompt holds the first turn: its input and its reply
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_another_tenant_cannot_read_or_continue_a_response(client, embedded):
    mine = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    stranger = openai.OpenAI(base_url=f"{embedded.base}/v1", api_key=embedded.keys["other"], max_retries=0)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as refused:
        stranger.responses.create(model=MODEL, input="x", previous_response_id=mine.id, max_output_tokens=4)
    assert refused.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        stranger.responses.delete(mine.id)
    assert client.responses.retrieve(mine.id).id == mine.id


def test_a_running_response_can_be_cancelled(client, embedded):
    started: dict = {}

    def stream_it() -> None:
        with client.responses.stream(
            model=MODEL, input="Tell me a long story", max_output_tokens=450, extra_body={"ignore_eos": True}
        ) as stream:
            for event in stream:
                if event.type == "response.created":
                    started["id"] = event.response.id
            started["final"] = event.response

    reader = threading.Thread(target=stream_it)
    reader.start()
    deadline = time.monotonic() + 30
    while "id" not in started and time.monotonic() < deadline:
        time.sleep(0.05)
    cancelled = client.responses.cancel(started["id"])
    reader.join(timeout=30)
    assert cancelled.status == "cancelled" and started["final"].status == "cancelled"
    assert started["final"].usage.output_tokens < 450
    assert client.responses.retrieve(started["id"]).status == "cancelled"


def test_parameters_we_do_not_serve_are_refused_by_name(client, embedded):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=MODEL,
            input="Hi",
            tools=[{"type": "web_search_preview"}],  # function tools are served: tests/tool_calling
        )
    assert refused.value.body["param"] == "tools"
    response = httpx.post(
        f"{embedded.base}/v1/responses",
        json={"model": MODEL, "input": "Hi", "no_such_field": 1},
        headers=embedded.auth("paid"),
        timeout=10,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "no_such_field"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_" + "0" * 32)
