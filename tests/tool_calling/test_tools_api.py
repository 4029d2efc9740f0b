"""Tool calling and reasoning over the chat API with the official openai SDK, against a real `tokenfleet replica`
and a real `tokenfleet serve --auth` (whose gateway folds the replica's stream for non-streamed clients), on the
Qwen3-template checkpoint with random weights: `required` and named tool choices make valid calls whatever the
weights, the SDK's assembled stream equals the non-streamed message, a tool round trip renders back into the
prompt, `auto` never fails, thinking goes to reasoning_content and usage's reasoning_tokens, and what we cannot
serve is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from .conftest import MODEL, SCHEMAS, TOOLS, Trip

MESSAGES = [{"role": "user", "content": "What should I do today?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def create(client: openai.OpenAI, **fields):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 160, "temperature": 0}
    return client.chat.completions.create(**{**body, "extra_body": NO_THINKING, **fields})


def calls_of(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def test_required_calls_validate_and_the_stream_assembles_to_the_whole_message(client):
    whole = create(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [(name, arguments)] = calls_of(whole.message)
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    call = whole.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 160, "temperature": 0}
    with client.chat.completions.stream(
        **body, tool_choice="required", parallel_tool_calls=False, extra_body=NO_THINKING
    ) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and calls_of(final.message) == calls_of(whole.message)
    pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(pieces) > 1 and "".join(e.arguments_delta for e in pieces) == arguments  # in pieces, in order


def test_parallel_required_calls_stream_as_the_whole_message(client):
    whole = create(client, tool_choice="required", max_tokens=300).choices[0]
    streamed = list(create(client, tool_choice="required", max_tokens=300, stream=True))
    calls: dict[int, list] = {}
    for chunk in streamed:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index not in calls and delta.function.name  # id, type and name once
                calls[delta.index] = [delta.function.name, ""]
            else:
                assert delta.function.name is None
            calls[delta.index][1] += delta.function.arguments or ""
    complete = calls_of(whole.message)  # a last call cut by max_tokens: streamed in part, not in the message
    assert [tuple(calls[i]) for i in sorted(calls)][: len(complete)] == complete
    assert streamed[-1].choices[0].finish_reason == whole.finish_reason
    if whole.finish_reason == "tool_calls":
        for name, arguments in calls_of(whole.message):
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_named_function_is_called_with_arguments_of_its_model(client):
    choice = {"type": "function", "function": {"name": "plan_trip"}}
    for seed in range(3):
        answer = create(client, tool_choice=choice, temperature=1.0, seed=seed).choices[0]
        assert answer.finish_reason == "tool_calls"
        assert [name for name, _ in calls_of(answer.message)] == ["plan_trip"]
        Trip.model_validate_json(answer.message.tool_calls[0].function.arguments)


def test_a_tool_round_trip_renders_back_and_answers(client):
    first = create(client, tool_choice="required", parallel_tool_calls=False)
    assistant = first.choices[0].message
    call = assistant.tool_calls[0]
    result = "The forecast says 21 degrees and sunshine over the whole valley."
    called = [*MESSAGES, assistant.model_dump(exclude_none=True)]
    answered = [*called, {"role": "tool", "tool_call_id": call.id, "content": result}]
    before = create(client, messages=called, tool_choice="none", max_tokens=1)
    second = create(client, messages=answered, tool_choice="none", max_tokens=8)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    # the call went back into the prompt, then the result
    assert before.usage.prompt_tokens - first.usage.prompt_tokens >= first.usage.completion_tokens // 2
    assert second.usage.prompt_tokens - before.usage.prompt_tokens >= 12
    auto = create(client, messages=answered, tool_choice="auto", max_tokens=8).choices[0]
    assert auto.finish_reason in ("stop", "length", "tool_calls")


def test_auto_lets_the_model_write_anything_and_never_fails(client):
    for stream in (False, True):
        for seed in range(3):
            fields = dict(tool_choice="auto", max_tokens=30, temperature=1.0, seed=seed)
            if stream:
                chunks = list(create(client, stream=True, **fields))
                assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
            else:
                answer = create(client, **fields).choices[0]
                assert answer.finish_reason in ("stop", "length", "tool_calls")
                assert answer.message.content is not None or answer.message.tool_calls


def test_thinking_goes_to_reasoning_content_and_is_counted(client):
    guided = {"structured_outputs": {"regex": "<think>[a-z]{6}</think>\n\n[a-z]{5}"}}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "temperature": 0}
    answer = client.chat.completions.create(**body, extra_body=guided)
    message = answer.choices[0].message
    assert len(message.reasoning_content) == 6 and len(message.content) == 5
    thinking = answer.usage.completion_tokens_details.reasoning_tokens
    assert 0 < thinking < answer.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(**body, extra_body=guided, stream=True, stream_options={"include_usage": True})
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking
    off = client.chat.completions.create(**body, extra_body={**guided, **NO_THINKING})
    # the template closed the thinking in the prompt: whatever the model writes is the answer
    assert off.choices[0].message.content.startswith("<think>")
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.usage.completion_tokens_details is None


BAD = [
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
            "tool_choice": "required",
        },
        "tools",
    ),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages.0"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra, param", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_what_we_cannot_serve_is_a_400_naming_the_field(qwen_replica, qwen_platform, extra, param, stream):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, "stream": stream, **extra}
    for base, headers in ((qwen_replica, {}), (qwen_platform.base, qwen_platform.auth("paid"))):
        response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 400, (base, response.text[:300])
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error


MALFORMED = [
    {"tools": "get_weather"},
    {"tools": [1, 2]},
    {"tools": [{"type": "function", "function": "get_weather"}]},
    {"tools": [{"type": "function"}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
    {"tools": [{"type": "function", "function": {"name": "f" * 65}}]},
    {"tool_choice": 3},
    {"tool_choice": {"type": "function"}},
    {"tool_choice": {"type": "function", "function": {"name": 5}}},
    {"parallel_tool_calls": [1]},
    {"chat_template_kwargs": ["enable_thinking"]},
    {"messages": [{"role": "assistant", "tool_calls": "x"}]},
    {"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": [1]}}]}]},
    {"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "a", "function": {"name": "f"}}]}]},
    {"messages": [{"role": "tool", "tool_call_id": 5, "content": "x"}]},
]


@pytest.mark.parametrize("extra", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_tool_fields_are_400s_never_5xx(qwen_replica, qwen_platform, extra):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}
    for base, headers in ((qwen_replica, {}), (qwen_platform.base, qwen_platform.auth("paid"))):
        response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 400, (base, extra, response.text[:300])
        assert response.json()["error"]["type"] == "invalid_request_error"
