"""A replica that dies under a constrained request (response_format json_schema, guided_*): a continuation on
another replica would be a text completion without the grammar, and its output might not validate. So one that had
generated nothing starts over elsewhere with its grammar, and one cut mid-output ends with an error rather than
unconstrained text; an unconstrained request still continues where it stopped."""

from __future__ import annotations

import asyncio
import json

from tests.gateway.inprocess import MODEL, inprocess_gateway
from tests.gateway.test_admission import RecordingUpstream
from tokenfleet.api.errors import APIError

SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


class DyingUpstream(RecordingUpstream):
    """Sends `before` tokens, then fails as a replica that broke off does (the HTTP upstream's error)."""

    def __init__(self, before: int, name: str) -> None:
        super().__init__(name=name)
        self.before = before

    async def stream(self, kind: str, body: dict):
        self.bodies.append(body)
        for i in range(self.before):
            yield {
                "id": "x",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": f"d{i}"}, "finish_reason": None}],
                "usage": {"prompt_tokens": 5, "completion_tokens": i + 1},
            }
        raise APIError(502, "replica broke off", "server_error", code="upstream_error")


def run(demo_model_dir, dying: DyingUpstream, **extra) -> tuple[list[dict], RecordingUpstream]:
    healthy = RecordingUpstream(name="healthy")
    gateway = inprocess_gateway(demo_model_dir, [dying, healthy])
    gateway.router.models[MODEL].choose = _dying_first(gateway.router.models[MODEL], dying.name)

    async def main() -> list[dict]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **extra}
        relay = await gateway.admit("chat", {**body, "stream": True}, gateway.auth.open_caller)
        await relay.finished.wait()
        events = [e async for e in gateway.buffer.read(relay.request_id, 0)]
        return [json.loads(e.data) for e in events if e.data != "[DONE]"]

    return asyncio.run(main()), healthy


def _dying_first(pools, dying: str):
    choose = pools.choose

    def first_the_dying_one(token_ids, affinity=None, exclude=()):
        replica, choice = choose(token_ids, affinity, exclude)
        if dying not in exclude and replica.name != dying:
            return pools.replicas[dying], choice
        return replica, choice

    return first_the_dying_one


def test_a_constrained_request_that_generated_nothing_starts_over_with_its_grammar(demo_model_dir):
    events, healthy = run(demo_model_dir, DyingUpstream(0, "dying"), response_format=SCHEMA)
    assert healthy.bodies and healthy.bodies[0]["response_format"] == SCHEMA and "messages" in healthy.bodies[0]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in events if c.get("choices")) == "t0t1t2"


def test_a_constrained_request_cut_mid_output_ends_with_an_error_not_unconstrained_text(demo_model_dir):
    events, healthy = run(demo_model_dir, DyingUpstream(2, "dying"), guided_regex="[a-z]+")
    assert not healthy.bodies, "continued without its grammar"
    assert events[-1]["error"]["code"] == "upstream_error"


def test_an_unconstrained_request_still_continues_where_it_stopped(demo_model_dir):
    events, healthy = run(demo_model_dir, DyingUpstream(2, "dying"))
    assert healthy.bodies and "prompt" in healthy.bodies[0], "a continuation is a text completion of the prompt"
    assert any("retrying" in c for c in events)


def test_a_request_with_tools_cut_mid_output_is_not_continued_as_plain_text(demo_model_dir):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    events, healthy = run(demo_model_dir, DyingUpstream(2, "dying"), tools=tools)
    assert not healthy.bodies, "continued without its tool-call parsing"
    assert events[-1]["error"]["code"] == "upstream_error"
