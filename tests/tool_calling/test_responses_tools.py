"""Function tools in the Responses API with the official SDK against `tokenfleet serve --auth` (Qwen3-template
checkpoint, random weights): tool_choice required returns a function_call item whose arguments validate, streamed
as OpenAI's typed events in order; the call's output goes back as a function_call_output item, after
previous_response_id or with the call itself in the input; tools we do not serve are a 400 naming them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from .conftest import MODEL, SCHEMAS, TIME, WEATHER

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "parameters": TIME, "strict": True},
]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture
def client(qwen_platform) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{qwen_platform.base}/v1", api_key=qwen_platform.keys["paid"], max_retries=0)


def call_once(client: openai.OpenAI, **fields):
    body = dict(model=MODEL, input="What is the weather in Oslo?", tools=TOOLS, max_output_tokens=120, temperature=0)
    return client.responses.create(
        **{**body, "tool_choice": "required", "parallel_tool_calls": False, "extra_body": NO_THINKING, **fields}
    )


def test_required_returns_a_function_call_item(client):
    response = call_once(client)
    assert response.status == "completed" and response.tool_choice == "required"
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.status == "completed" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert [tool.name for tool in response.tools] == ["get_weather", "get_time"]
    named = call_once(client, tool_choice={"type": "function", "name": "get_time"})
    assert [item.name for item in named.output if item.type == "function_call"] == ["get_time"]


def test_a_streamed_call_is_typed_events_in_order(client):
    body = dict(model=MODEL, input="What time is it?", tools=TOOLS, max_output_tokens=120, temperature=0)
    with client.responses.stream(
        **body, tool_choice="required", parallel_tool_calls=False, extra_body=NO_THINKING
    ) as stream:
        events = list(stream)
    types = [event.type for event in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and set(types[3:-3]) == {"response.function_call_arguments.delta"}
    final = events[-1].response
    [call] = final.output
    assert "".join(deltas) == call.arguments == events[-3].arguments == events[-2].item.arguments
    whole = call_once(client, input="What time is it?")
    assert [(i.name, i.arguments) for i in whole.output] == [(call.name, call.arguments)]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_the_calls_output_goes_back_after_previous_response_id(client):
    first = call_once(client)
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees, light wind."}
    again = dict(tools=TOOLS, tool_choice="none", max_output_tokens=6, temperature=0)  # tools go with each request
    second = client.responses.create(model=MODEL, input=[result], previous_response_id=first.id, **again)
    assert second.status in ("completed", "incomplete") and second.output[0].type == "message"
    # the chain's prompt holds the first turn (its input and its call) and the call's output
    assert second.usage.input_tokens >= first.usage.input_tokens + first.usage.output_tokens // 2 + 8
    alone = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            result,
        ],
        **again,
    )
    assert alone.status in ("completed", "incomplete") and alone.output_text == second.output_text
    assert alone.usage.input_tokens == second.usage.input_tokens


def test_tools_we_do_not_serve_are_refused_by_name(client):
    for tools, choice, param in (
        ([{"type": "web_search_preview"}], None, "tools"),
        (TOOLS, {"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice"),
        ([{"type": "function", "name": "f", "parameters": {"not": {}}, "strict": True}], "required", "tools"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(
                model=MODEL, input="Hi", tools=tools, max_output_tokens=4, **({"tool_choice": choice} if choice else {})
            )
        assert refused.value.body["param"] == param
