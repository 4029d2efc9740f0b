"""Usage parsed once where a replica's stream enters the gateway: any OpenAI-compatible server's usage object
(ours with metering's engine time, vLLM's with null details, a broken one) becomes one typed record, and clients
only ever see OpenAI's usage object, in the shape each format promises."""

from __future__ import annotations

import json

import pytest

from tokenfleet.api.usage import Usage
from tokenfleet.gateway.chunks import Chunk, Retrying
from tokenfleet.gateway.formats import NativeFormat, OpenAIFormat

OURS = {
    "prompt_tokens": 7,
    "completion_tokens": 3,
    "total_tokens": 10,
    "prompt_tokens_details": {"cached_tokens": 4},
    "engine_s": 0.25,
}


@pytest.mark.parametrize(
    ("wire", "parsed"),
    [
        (OURS, Usage(7, 3, 4, 0.25)),
        ({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": None}, Usage(7, 3)),
        ({"completion_tokens": 3}, Usage(0, 3)),
        ({"prompt_tokens": -1, "completion_tokens": True, "engine_s": "x"}, Usage()),
        ({"prompt_tokens": 2, "prompt_tokens_details": "cached"}, Usage(2)),
    ],
)
def test_any_servers_usage_object_parses_to_one_record(wire, parsed):
    assert Usage.parse(wire) == parsed


@pytest.mark.parametrize("wire", [None, {}, [], "usage", 3])
def test_no_usage_is_none(wire):
    assert Usage.parse(wire) is None


def test_the_record_round_trips_through_the_resume_buffers_json():
    usage = Usage(7, 3, 4, 0.25)
    assert Usage.from_json(usage.to_json()) == usage
    assert usage.total_tokens == 10


def chunk(usage: dict | None = None, content: str | None = "hi") -> Chunk:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}, "finish_reason": None}]
    data = {"id": "replica-id", "object": "chat.completion.chunk", "choices": choices}
    return Chunk.from_wire({**data, **({"usage": usage} if usage is not None else {})})


def test_a_chunk_keeps_its_usage_apart_and_clients_never_see_the_engine_time():
    c = chunk(OURS)
    assert "usage" not in c.data and c.usage == Usage(7, 3, 4, 0.25)
    assert c.with_client_usage()["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_openai_format_sends_usage_only_where_the_client_asked_for_it():
    plain, final, continuous = OpenAIFormat("r", False), OpenAIFormat("r", True), OpenAIFormat("r", True, True)
    assert "usage" not in json.loads(plain.chunk(chunk(OURS))[0][0])
    assert plain.chunk(chunk(OURS, content=None)) == []
    closing = json.loads(final.chunk(chunk(OURS, content=None))[0][0])
    assert closing["id"] == "r" and closing["usage"]["total_tokens"] == 10 and "engine_s" not in closing["usage"]
    every = json.loads(continuous.chunk(chunk(OURS))[0][0])
    assert every["usage"]["completion_tokens"] == 3 and "engine_s" not in every["usage"]


def test_native_format_ends_with_the_counts_and_names_a_retry():
    fmt = NativeFormat("r")
    [(data, name)] = fmt.chunk(chunk(OURS, content=None))
    assert name == "done" and json.loads(data)["usage"] == {"input_tokens": 7, "cached_tokens": 4, "output_tokens": 3}
    [(data, name)] = fmt.retrying(Retrying(2, "stream_broken"))
    assert name == "retrying" and json.loads(data) == {"attempt": 2, "reason": "stream_broken"}
