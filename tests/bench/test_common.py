"""bench/_common.py: the pieces the benchmark scripts share (the scripts themselves run by hand, never here)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _common import ChatStream, known_names, pct, prompt_text  # noqa: E402
from _cpuprobe import timed_run  # noqa: E402


def _sse(*lines: str) -> list[bytes]:
    return [f"{line}\n\n".encode() for line in lines]


def _data(obj: dict) -> str:
    return "data: " + json.dumps(obj)


def _delta(text: str, finish: str | None = None) -> str:
    return _data({"choices": [{"delta": {"content": text}, "finish_reason": finish}]})


def _read(status: int, parts: list[bytes], drop_after: int | None = None) -> tuple[ChatStream, str | None]:
    async def body():
        for i, part in enumerate(parts):
            if i == drop_after:
                raise httpx.ReadError("connection dropped")
            yield part

    async def scenario():
        stream = ChatStream()
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body()))
        async with httpx.AsyncClient(transport=transport) as client:
            try:
                async with client.stream("POST", "http://bench/v1/chat/completions") as r:
                    err = await stream.read(r, limit=20)
            except httpx.ReadError as e:
                err = str(e)
        return stream, err

    return asyncio.run(scenario())


def test_chat_stream_collects_content_usage_and_finish():
    usage = {"prompt_tokens": 5, "completion_tokens": 2}
    stream, err = _read(
        200,
        _sse(
            ": ping",
            _delta("a"),
            _delta("b", "length"),
            _data({"choices": [], "usage": usage}),
            "data: [DONE]",
            _delta("after the end"),
        ),
    )
    assert err is None
    assert [piece for _, piece in stream.content] == ["a", "b"]
    assert stream.first_content_at == stream.content[0][0]
    assert (stream.usage, stream.finish) == (usage, "length")


@pytest.mark.parametrize("event", [{"error": {"message": "x" * 50}}, {"object": "error", "message": "bad"}])
def test_chat_stream_stops_at_an_error_event(event):
    stream, err = _read(200, _sse(_delta("a"), _data(event), _delta("b")))
    assert err.startswith("error event: ") and len(err) == len("error event: ") + 20
    assert [piece for _, piece in stream.content] == ["a"]


def test_chat_stream_reports_a_non_200_answer():
    stream, err = _read(503, [b"overloaded" * 10])
    assert err == "HTTP 503: " + ("overloaded" * 10)[:20]
    assert stream.content == [] and stream.first_content_at is None


def test_chat_stream_keeps_what_came_before_a_dropped_connection():
    stream, err = _read(200, _sse(_delta("a"), _delta("b")), drop_after=1)
    assert err == "connection dropped"
    assert [piece for _, piece in stream.content] == ["a"]


def test_pct_interpolates_linearly():
    assert pct([], 50) is None
    assert pct([4.0, 1.0, 2.0, 3.0], 50) == 2.5
    assert pct([1.0, 2.0, 3.0], 100) == 3.0


def test_known_names_keeps_the_known_order_and_refuses_unknown_ones():
    parser = argparse.ArgumentParser()
    assert known_names(parser, "c, a,,", ["a", "b", "c"], "systems") == ["a", "c"]
    with pytest.raises(SystemExit):
        known_names(parser, "a,z", ["a", "b"], "systems")


def test_prompt_text_has_exactly_the_tokens_asked_for(demo_model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    rng = random.Random(0)
    for n in (1, 7, 64):
        assert len(tok.encode(prompt_text(rng, tok, n), add_special_tokens=False).ids) == n


def test_timed_run_returns_the_result_and_its_wall_time():
    result, wall, others = timed_run(sorted, [3, 1, 2])
    assert result == [1, 2, 3] and wall >= 0
    assert others is None or others >= 0
