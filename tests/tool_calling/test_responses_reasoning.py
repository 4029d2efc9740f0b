"""The model's thinking in the Responses API, with the official SDK against `tokenfleet serve --auth` on the
Qwen3-template checkpoint (random weights, so a vLLM-style `structured_outputs` regex makes it think and then
answer): a `reasoning` item (its text as one reasoning_text content part, an empty summary) before the message,
usage's output_tokens_details.reasoning_tokens, the stream's typed events in OpenAI's order assembled by the SDK
into the same response, and the reasoning item accepted back as input and carried by previous_response_id."""

from __future__ import annotations

import openai
import pytest

from .conftest import MODEL

THINK_THEN_ANSWER = {"structured_outputs": {"regex": "<think>[a-z]{6}</think>\n\n[a-z]{5}"}}
BODY = dict(model=MODEL, input="What should I do today?", max_output_tokens=60, temperature=0)


@pytest.fixture
def client(qwen_platform) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{qwen_platform.base}/v1", api_key=qwen_platform.keys["paid"], max_retries=0)


def test_thinking_is_a_reasoning_item_before_the_message_and_is_counted(client):
    response = client.responses.create(**BODY, extra_body=THINK_THEN_ANSWER)
    assert response.status == "completed"
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.status == "completed"
    assert reasoning.summary == [] and [part.type for part in reasoning.content] == ["reasoning_text"]
    assert len(reasoning.content[0].text) == 6 and reasoning.content[0].text.isalpha()
    assert message.type == "message" and len(response.output_text) == 5
    details = response.usage.output_tokens_details
    assert 0 < details.reasoning_tokens < response.usage.output_tokens
    assert client.responses.retrieve(response.id).output[0].content[0].text == reasoning.content[0].text


def test_streamed_thinking_is_typed_events_in_order_and_assembles_to_the_whole_response(client):
    whole = client.responses.create(**BODY, extra_body=THINK_THEN_ANSWER)
    with client.responses.stream(**BODY, extra_body=THINK_THEN_ANSWER) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    reasoning_deltas = [i for i, t in enumerate(types) if t == "response.reasoning_text.delta"]
    text_deltas = [i for i, t in enumerate(types) if t == "response.output_text.delta"]
    assert reasoning_deltas and text_deltas and reasoning_deltas[-1] < text_deltas[0]
    assert types[: reasoning_deltas[0]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[reasoning_deltas[-1] + 1 : text_deltas[0]] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[text_deltas[-1] + 1 :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, part = events[2], events[3]
    assert added.item.type == "reasoning" and added.output_index == 0 and part.part.type == "reasoning_text"
    thinking = "".join(events[i].delta for i in reasoning_deltas)
    assert all(events[i].item_id == added.item.id and events[i].content_index == 0 for i in reasoning_deltas)
    assert events[reasoning_deltas[-1] + 1].text == thinking == whole.output[0].content[0].text
    assert events[reasoning_deltas[-1] + 3].item.content[0].text == thinking
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == thinking and final.output_text == whole.output_text
    assert final.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens_details.reasoning_tokens


def test_a_reasoning_item_goes_back_as_input_and_through_a_chain(client):
    first = client.responses.create(**BODY, extra_body=THINK_THEN_ANSWER)
    turn = [{"role": "user", "content": BODY["input"]}, *[item.model_dump() for item in first.output]]
    manual = client.responses.create(
        **{**BODY, "input": [*turn, {"role": "user", "content": "And?"}]}, extra_body=THINK_THEN_ANSWER
    )
    chained = client.responses.create(
        **{**BODY, "input": "And?"}, previous_response_id=first.id, extra_body=THINK_THEN_ANSWER
    )
    # the same prompt either way: the first turn (its reasoning item read back), then the new input
    assert manual.usage.input_tokens == chained.usage.input_tokens > first.usage.input_tokens
    assert [item.type for item in chained.output] == ["reasoning", "message"]
