"""Replies from the real engine in process: stop frees the sequence's KV blocks at once and keeps the text so
far; continue goes on from it; the saved token counts are the engine's."""

from __future__ import annotations

import asyncio

import pytest

from tests.conversations.helpers import conversations_app, parse_sse, reply_text, wait_for
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.config import EngineConfig
from tokenfleet.gateway.upstream import InProcessUpstream
from tokenfleet.model.tokenizer import Tokenizer
from tokenfleet.replica.metrics import load_report
from tokenfleet.replica.server import ReplicaService

pytestmark = pytest.mark.anyio
# long enough to still be generating when the test looks, however fast the machine
LONG = {"max_tokens": 1900, "ignore_eos": True, "temperature": 0}
WINDOW = 2048


@pytest.fixture
def engine(demo_model_dir):
    engine = AsyncEngine(
        EngineConfig(model=str(demo_model_dir), kv_cache_gib=0.05, swap_space_gib=0.01, max_model_len=WINDOW)
    )
    yield engine
    engine.shutdown()


def idle(engine: AsyncEngine):
    """A predicate for wait_for: nothing running or waiting, every KV block free."""

    async def check() -> bool:
        report = load_report(engine.engine)
        return report["running"] == 0 and report["waiting"] == 0 and report["kv_usage"] == 0

    return check


async def test_stop_frees_the_kv_blocks_and_continue_goes_on(demo_model_dir, db, engine):
    upstream = InProcessUpstream(ReplicaService(engine, "tiny"))
    async with conversations_app(demo_model_dir, db, [upstream], WINDOW, save_interval_s=0.1) as (client, _, users):
        auth = users.auth("ann")
        conv = (await client.post("/v1/conversations", json={"system_prompt": "S"}, headers=auth)).json()["id"]
        posting = asyncio.ensure_future(
            client.post(f"/v1/conversations/{conv}/messages", json={"content": "Tell me a story", **LONG}, headers=auth)
        )

        async def partial():
            data = (await client.get(f"/v1/conversations/{conv}/messages", headers=auth)).json()["data"]
            return data[0] if data and data[0]["role"] == "assistant" and data[0]["tokens"] >= 5 else None

        seen = await wait_for(partial, timeout=30)
        assert seen and seen["status"] == "streaming" and seen["content"], "a refresh shows the text so far"
        assert load_report(engine.engine)["running"] == 1
        stopped = (await client.post(f"/v1/messages/{seen['id']}/stop", headers=auth)).json()
        assert stopped["status"] == "stopped" and stopped["content"].startswith(seen["content"])
        assert seen["tokens"] <= stopped["tokens"] < 1900
        assert await wait_for(idle(engine), timeout=5), load_report(engine.engine)
        events = parse_sse((await posting).text)
        assert reply_text(events) == stopped["content"]
        assert events[-1][1]["usage"]["output"] == stopped["tokens"]

        more = parse_sse(
            (
                await client.post(
                    f"/v1/messages/{seen['id']}/continue", json={"max_tokens": 20, "ignore_eos": True}, headers=auth
                )
            ).text
        )
        done = more[-1][1]
        assert (done["status"], done["finishReason"], done["usage"]["output"]) == ("complete", "length", 20)
        final = (await client.get(f"/v1/messages/{seen['id']}", headers=auth)).json()
        assert final["content"] == stopped["content"] + reply_text(more) and final["tokens"] == stopped["tokens"] + 20
        prompt = Tokenizer.from_dir(demo_model_dir).encode_chat(
            [{"role": "system", "content": "S"}, {"role": "user", "content": "Tell me a story"}],
            add_generation_prompt=True,
        )
        assert done["usage"]["input"] >= len(prompt) + 1, "the prompt held the reply so far"
        assert await wait_for(idle(engine), timeout=5)


async def test_a_client_that_hangs_up_does_not_stop_the_reply(demo_model_dir, db, engine):
    """In process the client's stream is cut by cancelling the request; the reply is generated to its end."""
    upstream = InProcessUpstream(ReplicaService(engine, "tiny"))
    async with conversations_app(demo_model_dir, db, [upstream], WINDOW, save_interval_s=0.1) as (client, _, users):
        auth = users.auth("ann")
        conv = (await client.post("/v1/conversations", json={}, headers=auth)).json()["id"]
        posting = asyncio.ensure_future(
            client.post(f"/v1/conversations/{conv}/messages", json={"content": "Go", **LONG}, headers=auth)
        )

        async def streaming():
            data = (await client.get(f"/v1/conversations/{conv}/messages", headers=auth)).json()["data"]
            return data[0] if data and data[0]["role"] == "assistant" and data[0]["tokens"] else None

        reply = await wait_for(streaming, timeout=30)
        assert reply and reply["status"] == "streaming"
        posting.cancel()
        await asyncio.gather(posting, return_exceptions=True)

        async def finished():
            found = (await client.get(f"/v1/messages/{reply['id']}", headers=auth)).json()
            return found if found["status"] != "streaming" else None

        final = await wait_for(finished, timeout=120)
        assert final and (final["status"], final["tokens"], final["finish_reason"]) == ("complete", 1900, "length")
