"""Parameters OpenAI defines that our engine does not serve are refused by name, never accepted and ignored (an
agent's tools silently never called); through the gateway to another OpenAI-compatible server they pass as sent."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL
from tests.gateway.inprocess import inprocess_gateway
from tests.gateway.test_admission import RecordingUpstream
from tokenfleet.gateway.app import create_gateway_app

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": TOOLS}, "tools"),  # the demo checkpoint's template writes no tool calls (see tests/tool_calling)
        ({"functions": [TOOLS[0]["function"]]}, "functions"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"store": True}, "store"),
    ],
)
def test_our_replica_refuses_what_it_does_not_serve_by_name(embedded, extra, param):
    client = openai.OpenAI(base_url=f"{embedded.base}/v1", api_key=embedded.keys["paid"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body=extra
        )
    assert refused.value.body["param"] == param and refused.value.body["code"] == "unsupported_parameter"


def test_defaults_that_ask_for_nothing_are_served(embedded):
    client = openai.OpenAI(base_url=f"{embedded.base}/v1", api_key=embedded.keys["paid"], max_retries=0)
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"tool_choice": "none", "modalities": ["text"], "store": False, "logit_bias": {}},
    )
    assert answer.choices[0].message.content is not None


def test_to_another_openai_compatible_server_they_pass_as_sent(demo_model_dir):
    upstream = RecordingUpstream()

    async def main() -> httpx.Response:
        gateway = inprocess_gateway(demo_model_dir, [upstream])
        transport = httpx.ASGITransport(app=create_gateway_app(gateway))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "tools": TOOLS}
            return await client.post("/v1/chat/completions", json={**body, "tool_choice": "required"})

    response = asyncio.run(main())
    assert response.status_code == 200
    assert upstream.bodies[0]["tools"] == TOOLS and upstream.bodies[0]["tool_choice"] == "required"
