"""A prefill replica's side of a transfer whose decode replica dies, stalls or refuses mid-way: the request fails
with a clear error the gateway falls back on, and the prefill engine is left with no request and no block held."""

from __future__ import annotations

import asyncio

import pytest

from tests.checkpoints import SMALL_KV, make_checkpoint
from tokenfleet.api.errors import APIError
from tokenfleet.engine.async_engine import AsyncEngine
from tokenfleet.engine.config import EngineConfig
from tokenfleet.replica.disagg import PrefillService
from tokenfleet.replica.kv_transport import TcpKVReceiver, read_frame, write_frame

PROMPT = [5 + (i * 11) % 350 for i in range(300)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("prefill"), "llama")
    engine = AsyncEngine(
        EngineConfig.from_options(str(path), skip_tokenizer_init=True, max_num_batched_tokens=32, **SMALL_KV)
    )
    yield engine
    engine.shutdown()


async def fake_decode_replica(behaviour: str) -> tuple[asyncio.Server, str]:
    """A KV receiver that answers open with have=0, then: "dies" after the first blocks, "stalls" (never answers
    done), or "refuses" the first chunk."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader, 5)
        await write_frame(writer, {"ok": True, "value": 0})
        await read_frame(reader, 5)
        if behaviour == "dies":
            writer.transport.abort()
            return
        if behaviour == "refuses":
            await write_frame(writer, {"ok": False, "error": "no room for these blocks"})
            writer.close()
            return
        while True:  # stalls: reads on, never answers
            await read_frame(reader, 60)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


def assert_clean(engine: AsyncEngine) -> None:
    inner = engine.engine
    for _ in range(100):
        if not inner.has_unfinished():
            break
        asyncio.run(asyncio.sleep(0.01))
    assert not inner.has_unfinished()
    assert inner.blocks.num_free_blocks == inner.blocks.num_blocks


@pytest.mark.parametrize("behaviour", ["dies", "stalls", "refuses"])
def test_a_decode_replica_failing_mid_transfer(engine, behaviour):
    async def scenario() -> APIError:
        server, address = await fake_decode_replica(behaviour)
        from tokenfleet.replica.kv_transport import TcpKVSender

        service = PrefillService(engine, TcpKVSender(timeout_s=0.5))
        service.peers["http://decode"] = (address, engine.kv_layout)  # as /internal/kv/info would have said
        try:
            with pytest.raises(APIError) as failed:
                await asyncio.wait_for(service.prefill(PROMPT, "http://decode", "req-1"), 10)
        finally:
            server.close()
            await service.aclose()
        return failed.value

    error = asyncio.run(scenario())
    assert error.status == (409 if behaviour == "refuses" else 424)
    assert error.code == ("kv_transfer_refused" if behaviour == "refuses" else "kv_transfer_failed")
    assert "decode" in error.message
    assert_clean(engine)


def test_a_whole_transfer_through_the_service(engine):
    async def scenario():
        decode = AsyncEngine(engine=None, config=engine.engine.config)
        receiver = TcpKVReceiver(decode.kv_layout, decode.exchange)
        port = await receiver.start("127.0.0.1", 0)
        service = PrefillService(engine)
        service.peers["http://decode"] = (f"127.0.0.1:{port}", decode.kv_layout)
        try:
            stats = await service.prefill(PROMPT, "http://decode", "req-2")
            again = await service.prefill(PROMPT, "http://decode", "req-3")
        finally:
            await receiver.stop()
            await service.aclose()
            decode.shutdown()
        return stats, again

    stats, again = asyncio.run(scenario())
    usable = (len(PROMPT) - 1) // 16
    assert stats.blocks_sent == usable == stats.held and stats.blocks_skipped == 0
    assert again.blocks_sent == 0 and again.blocks_skipped == usable  # the decode side held them: nothing computed
    assert_clean(engine)


def test_an_unreachable_decode_replica_is_asked_for_its_address_again(engine):
    """A decode replica that restarted listens for transfers on a new port: the old address is not kept."""

    async def scenario() -> tuple[APIError, dict]:
        server, address = await fake_decode_replica("dies")
        server.close()
        await server.wait_closed()
        service = PrefillService(engine)
        service.peers["http://decode"] = (address, engine.kv_layout)
        try:
            with pytest.raises(APIError) as failed:
                await service.prefill(PROMPT, "http://decode", "req-4")
        finally:
            await service.aclose()
        return failed.value, service.peers

    error, peers = asyncio.run(scenario())
    assert error.status == 424 and "cannot reach decode replica" in error.message
    assert "http://decode" not in peers
    assert_clean(engine)


def test_the_client_to_decode_replicas_closes_with_the_server(engine):
    """The app's lifespan holds `serving()`: when the server stops, the client's connections close with it."""

    async def scenario() -> tuple[bool, bool]:
        service = PrefillService(engine)
        async with service.serving():
            open_while_serving = not service.http.is_closed
        return open_while_serving, service.http.is_closed

    assert asyncio.run(scenario()) == (True, True)
