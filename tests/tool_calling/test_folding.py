"""What the gateway makes of a replica's streamed tool calls: the chat completion a non-streaming client gets
(gateway/aggregate.py), the Responses API's items and events (gateway/responses_format.py: reasoning, message and
function call items), the usage record's reasoning tokens, and a stored response read back as the next turn's
messages."""

from __future__ import annotations

import json

from tokenfleet.api.usage import Usage
from tokenfleet.gateway.aggregate import aggregate
from tokenfleet.gateway.chunks import Chunk
from tokenfleet.gateway.responses_format import ResponsesFormat
from tokenfleet.responses.store import StoredResponse


def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> Chunk:
    data = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    data["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
    return Chunk.from_wire({**data, **({"usage": usage} if usage else {})})


def call(index: int, arguments: str, name: str | None = None) -> dict:
    if name is None:
        return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}
    function = {"name": name, "arguments": arguments}
    return {"tool_calls": [{"index": index, "id": f"call_{index}", "type": "function", "function": function}]}


STREAM = [
    chunk({"role": "assistant", "reasoning_content": "Think"}),
    chunk({"reasoning_content": "ing."}),
    chunk({"content": "Checking."}),
    chunk(call(0, "", "get_weather")),
    chunk(call(0, '{"city": ')),
    chunk(call(0, '"Oslo"}')),
    chunk(call(1, '{"tz"', "get_time")),
    chunk(call(1, ': "UTC"}')),
    chunk({}, "tool_calls"),
    Chunk({"id": "c", "choices": []}, Usage(10, 9, 0, 0.1, reasoning_tokens=3)),
]


def test_a_non_streamed_client_gets_the_calls_whole():
    body = aggregate(STREAM, "chat")
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "Thinking.",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}},
        ],
    }
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}


def test_a_call_that_never_completed_is_left_out_and_content_is_null_without_text():
    cut = [chunk(call(0, '{"a": 1}', "f")), chunk(call(1, '{"b": ', "g")), chunk({"content": ""}, "length")]
    [choice] = aggregate(cut, "chat")["choices"]
    assert choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["f"]


def test_usage_reasoning_tokens_round_trip_and_stay_tolerant():
    usage = Usage(7, 5, 2, 0.5, reasoning_tokens=4)
    assert Usage.from_json(usage.to_json()) == usage
    assert "completion_tokens_details" not in Usage(7, 5).for_client()
    odd = {"prompt_tokens": 3, "completion_tokens": 2, "completion_tokens_details": {"reasoning_tokens": "x"}}
    assert Usage.parse(odd) == Usage(3, 2)
    assert Usage.parse({**odd, "completion_tokens_details": None}) == Usage(3, 2)


def test_responses_items_come_one_after_the_other_in_openais_order():
    fmt = ResponsesFormat("req", "resp_1", {"model": "m"})
    events = fmt.start() + [e for c in STREAM for e in fmt.chunk(c)] + fmt.end()
    bodies = [json.loads(data) for data, _ in events]
    assert [b["sequence_number"] for b in bodies] == list(range(len(bodies)))
    names = [b["type"] for b in bodies]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = bodies[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    reasoning, message, weather, time = final["output"]
    assert reasoning == {
        "id": reasoning["id"],
        "type": "reasoning",
        "status": "completed",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Thinking."}],
    }
    assert message["content"][0]["text"] == "Checking." and message["status"] == "completed"
    assert (weather["type"], weather["call_id"], weather["name"]) == ("function_call", "call_0", "get_weather")
    assert weather["arguments"] == '{"city": "Oslo"}' and time["arguments"] == '{"tz": "UTC"}'
    assert [b["output_index"] for b in bodies if b["type"] == "response.output_item.added"] == [0, 1, 2, 3]
    assert [b["part"]["type"] for b in bodies if b["type"] == "response.content_part.added"] == [
        "reasoning_text",
        "output_text",
    ]
    stored = StoredResponse("resp_1", "req", None, [{"role": "user", "content": "Hi"}], final)
    assert stored.turn()[-1] == {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "Thinking.",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}},
        ],
    }


def test_a_response_cut_mid_call_is_incomplete():
    fmt = ResponsesFormat("req", "resp_2", {"model": "m"})
    for c in [chunk(call(0, '{"a": ', "f")), chunk({}, "length")]:
        fmt.chunk(c)
    final = json.loads(fmt.end()[-1][0])
    assert final["type"] == "response.incomplete" and final["response"]["output"][0]["status"] == "incomplete"
