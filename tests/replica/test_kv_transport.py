"""The KV transport on its own, over real TCP on loopback, with a recording importer in place of an engine: what
goes over, what the receiver skips, refuses and survives."""

from __future__ import annotations

import asyncio
import struct

import pytest

from tokenfleet.engine.kv_transfer import KVChunk, KVLayout
from tokenfleet.replica.kv_transport import TcpKVReceiver, TcpKVSender, TransferError

LAYOUT = KVLayout("abc123", 16, 2, 2, 16, "float32")
BLOCK = LAYOUT.bytes_per_block


class Importer:
    """Holds imported blocks of one prompt; `cached_prefix` is the leading run it holds."""

    def __init__(self, have: int = 0, fail_at: int | None = None) -> None:
        self.blocks: dict[int, bytes] = {i: b"" for i in range(have)}
        self.fail_at = fail_at

    async def __call__(self, method: str, token_ids: list[int], chunk: KVChunk | None = None) -> int:
        if method == "import_chunk":
            assert chunk is not None
            if self.fail_at is not None and chunk.first_block >= self.fail_at:
                raise ValueError("this chunk is broken")
            for i in range(chunk.num_blocks):
                self.blocks[chunk.first_block + i] = chunk.data[i * BLOCK : (i + 1) * BLOCK]
        held = 0
        while held in self.blocks:
            held += 1
        return held


def chunk(first: int, count: int) -> KVChunk:
    return KVChunk(first, count, bytes([first % 251]) * (count * BLOCK))


async def receiving(importer: Importer, timeout_s: float = 5.0) -> tuple[TcpKVReceiver, str]:
    receiver = TcpKVReceiver(LAYOUT, importer, timeout_s=timeout_s)
    port = await receiver.start("127.0.0.1", 0)
    return receiver, f"127.0.0.1:{port}"


def test_a_transfer_sends_only_what_the_receiver_lacks():
    async def scenario():
        importer = Importer(have=2)
        receiver, address = await receiving(importer)
        session = await TcpKVSender().connect(address)
        assert await session.open("t1", LAYOUT, list(range(100))) == 2
        for c in (chunk(0, 2), chunk(2, 2), chunk(4, 2)):
            await session.send(c)
        assert await session.finish() == 6
        await session.close()
        await receiver.stop()
        return importer, receiver, session

    importer, receiver, session = asyncio.run(scenario())
    assert session.stats.blocks_skipped == 2 and session.stats.blocks_sent == 4
    assert session.stats.bytes_sent == 4 * BLOCK == receiver.stats.bytes
    assert importer.blocks[4] == bytes([4]) * BLOCK
    assert receiver.stats.transfers == 1 and receiver.stats.failed == 0


def test_a_receiver_refuses_another_layout_and_says_why():
    async def scenario():
        receiver, address = await receiving(Importer())
        session = await TcpKVSender().connect(address)
        other = KVLayout("abc123", 32, 2, 2, 16, "float32")
        with pytest.raises(TransferError, match="block_size 16 here, 32 there") as e:
            await session.open("t1", other, list(range(100)))
        await session.close()
        await receiver.stop()
        return e.value, receiver

    error, receiver = asyncio.run(scenario())
    assert error.refused and receiver.stats.failed == 1


def test_a_bad_chunk_fails_the_transfer_at_finish():
    async def scenario():
        receiver, address = await receiving(Importer(fail_at=2))
        session = await TcpKVSender().connect(address)
        await session.open("t1", LAYOUT, list(range(100)))
        await session.send(chunk(0, 2))
        await session.send(chunk(2, 2))
        with pytest.raises((TransferError, ConnectionError)):
            await session.finish()
        await session.close()
        await asyncio.sleep(0.05)
        await receiver.stop()
        return receiver

    assert asyncio.run(scenario()).stats.failed == 1


def test_a_sender_that_dies_or_stalls_mid_transfer_leaves_the_receiver_going():
    async def scenario():
        importer = Importer()
        receiver, address = await receiving(importer, timeout_s=0.3)
        host, port = address.split(":")
        # one breaks off after a chunk; another stalls after open; a third sends garbage
        reader, writer = await asyncio.open_connection(host, int(port))
        session = await TcpKVSender().connect(address)
        await session.open("dies", LAYOUT, list(range(100)))
        await session.send(chunk(0, 1))
        await session.close()
        stalled = await TcpKVSender().connect(address)
        await stalled.open("stalls", LAYOUT, list(range(100)))
        writer.write(struct.pack(">I", 1 << 30))  # a header "of a GiB"
        await writer.drain()
        await asyncio.sleep(0.6)
        await stalled.close()
        writer.close()
        # and it still takes a good transfer
        good = await TcpKVSender().connect(address)
        await good.open("good", LAYOUT, list(range(100)))
        await good.send(chunk(1, 2))
        held = await good.finish()
        await good.close()
        await receiver.stop()
        return receiver, held

    receiver, held = asyncio.run(scenario())
    assert held == 3  # block 0 from the one that died stays: a free cached prefix, owned by no one
    assert receiver.stats.failed == 3 and receiver.stats.transfers == 1


def test_an_unreachable_receiver_fails_fast():
    async def scenario():
        receiver, address = await receiving(Importer())
        await receiver.stop()
        with pytest.raises(OSError):
            await TcpKVSender(connect_timeout_s=1.0).connect(address)

    asyncio.run(scenario())


def test_writing_to_a_receiver_that_died_is_a_connection_error_under_uvloop():
    """The replica servers run uvloop, whose closed transports raise RuntimeError on write: the transport turns that
    into the ConnectionError a broken transfer is (it was a 500 from the prefill replica before)."""
    import uvloop

    from tokenfleet.replica.kv_transport import write_frame

    async def scenario() -> None:
        async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.transport.abort()

        server = await asyncio.start_server(drop, "127.0.0.1", 0)
        _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        with pytest.raises(ConnectionError):
            for _ in range(100):  # the peer's reset arrives after a write or two
                await write_frame(writer, {"op": "blocks", "first": 0, "count": 1}, b"\0" * BLOCK)
                await asyncio.sleep(0.01)
        server.close()

    uvloop.run(scenario())
