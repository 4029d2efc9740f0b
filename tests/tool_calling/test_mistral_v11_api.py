"""Mistral's v11 calls (`[TOOL_CALLS]name[ARGS]{...}`, two special tokens) over the chat API with the official openai
SDK against a real `tokenfleet replica` on a Mistral-Small-3.2-style template (random weights): several calls in a
row stream as OpenAI's exact tool-call deltas (index, id and name once, arguments in pieces), and the stream
assembled is the non-streamed message; the ids are the 9 letters and digits Mistral's templates take."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.servers import free_port, running_process

from .conftest import MODEL, SCHEMAS, SERVER_ARGS, TOOLS

MESSAGES = [{"role": "user", "content": "What should I do today?"}]


@pytest.fixture(scope="module")
def client(template_models, tmp_path_factory) -> openai.OpenAI:
    logs, port = tmp_path_factory.mktemp("mistral-v11-replica"), free_port()
    args = ["replica", "--model", str(template_models["mistral_v11"]), "--port", str(port), *SERVER_ARGS]
    with running_process(args + ["--max-model-len", "2048"], f"http://127.0.0.1:{port}/health", logs / "log"):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)


def create(client: openai.OpenAI, **fields):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 300, "temperature": 0}
    return client.chat.completions.create(**{**body, **fields})


def calls_of(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def streamed_calls(chunks) -> tuple[dict[int, list], int]:
    """The calls as the deltas build them, checking OpenAI's shape; and how many argument pieces came."""
    calls: dict[int, list] = {}
    pieces = 0
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index == len(calls) and delta.type == "function" and delta.function.name
                assert len(delta.id) == 9 and delta.id.isalnum()
                calls[delta.index] = [delta.function.name, delta.function.arguments or ""]
            else:
                assert delta.index in calls and delta.function.name is None and delta.type is None
                calls[delta.index][1] += delta.function.arguments
                pieces += 1
    return calls, pieces


def test_parallel_v11_calls_stream_as_the_whole_message(client):
    whole = create(client, tool_choice="required").choices[0]
    complete = calls_of(whole.message)
    assert complete and whole.message.content is None
    assert all(len(call.id) == 9 and call.id.isalnum() for call in whole.message.tool_calls)
    chunks = list(create(client, tool_choice="required", stream=True))
    calls, pieces = streamed_calls(chunks)
    # a last call cut by max_tokens streams in part but is not in the message
    assert [tuple(calls[i]) for i in sorted(calls)][: len(complete)] == complete
    assert pieces > len(calls)  # arguments in pieces, not whole
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    if whole.finish_reason == "tool_calls":
        assert len(calls) == len(complete)
        for name, arguments in complete:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_several_v11_calls_in_a_row_each_validate(client):
    """Sampled: random weights write one call or several before stopping; each complete one validates."""
    several = 0
    for seed in range(4):
        answer = create(client, tool_choice="required", temperature=1.0, seed=seed).choices[0]
        for name, arguments in calls_of(answer.message):
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        several += len(answer.message.tool_calls or []) > 1
        if answer.finish_reason == "tool_calls":
            assert answer.message.content is None
    assert several > 0


def test_a_named_v11_call_is_one_call_to_that_function(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    answer = create(client, tool_choice=choice, max_tokens=120).choices[0]
    assert answer.finish_reason == "tool_calls"
    [(name, arguments)] = calls_of(answer.message)
    assert name == "get_time"
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_time"])
