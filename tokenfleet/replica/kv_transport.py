"""How a prefill replica's KV blocks reach a decode replica: a small transport interface, and its TCP implementation.

One transfer is one conversation, sender first:
    open   {transfer, layout, tokens}     -> {ok, have}   (the receiver checks the layout; `have`: leading blocks of
                                                           the prompt it holds already, which need not be sent)
    blocks {first, count} + the blocks' bytes, as each prefill chunk yields them (no reply: pipelined)
    done                                  -> {ok, held}   (once every block is in the receiver's prefix cache)
Each message is a frame: 4-byte header length, the JSON header, 8-byte payload length, the payload. Every read on
either side has a deadline, and a connection that breaks off leaves nothing behind: blocks imported so far are
free prefix-cache entries (engine/kv_transfer.py). The interface (KVSender, KVSession, the receiver's `importer`)
leaves room for other transports (shared memory on one host; NIXL or UCX between GPUs) beside TcpKVSender.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from tokenfleet.engine.kv_transfer import KVChunk, KVLayout

log = logging.getLogger(__name__)
HEADER = struct.Struct(">I")
PAYLOAD = struct.Struct(">Q")
MAX_HEADER_BYTES = 16 << 20  # a prompt's token ids as JSON: a million tokens fit
MAX_PAYLOAD_BYTES = 4 << 30


class TransferError(Exception):
    """The transfer failed; `refused` when the receiver answered no (a layout mismatch), not a broken connection."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass
class TransferStats:
    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_skipped: int = 0  # the receiver held them already
    held: int = 0  # leading prompt blocks the receiver holds at the end
    seconds: float = 0.0


class KVSession(Protocol):
    async def open(self, transfer_id: str, layout: KVLayout, token_ids: list[int]) -> int: ...

    async def send(self, chunk: KVChunk) -> None: ...

    async def finish(self) -> int: ...

    async def close(self) -> None: ...


class KVSender(Protocol):
    async def connect(self, address: str) -> KVSession: ...


# --- TCP ----------------------------------------------------------------------------------------------------------


async def write_frame(writer: asyncio.StreamWriter, header: dict[str, object], payload: bytes = b"") -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    if writer.is_closing():
        raise ConnectionResetError("the peer closed the connection")
    try:
        writer.write(HEADER.pack(len(raw)) + raw + PAYLOAD.pack(len(payload)))
        if payload:
            writer.write(payload)
        await writer.drain()
    except RuntimeError as e:  # uvloop, on a transport the peer has closed meanwhile
        raise ConnectionResetError(f"the peer closed the connection: {e}") from e


async def read_frame(reader: asyncio.StreamReader, timeout_s: float) -> tuple[dict[str, object], bytes]:
    async with asyncio.timeout(timeout_s):
        (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if size > MAX_HEADER_BYTES:
            raise TransferError(f"a frame header of {size} bytes is too large")
        header = json.loads(await reader.readexactly(size))
        (length,) = PAYLOAD.unpack(await reader.readexactly(PAYLOAD.size))
        if length > MAX_PAYLOAD_BYTES:
            raise TransferError(f"a frame payload of {length} bytes is too large")
        payload = await reader.readexactly(length) if length else b""
    if not isinstance(header, dict):
        raise TransferError("a frame header is a JSON object")
    return header, payload


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise TransferError(f"a KV address is host:port, got {address!r}")
    return host.strip("[]"), int(port)


class TcpKVSession:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout_s: float) -> None:
        self.reader, self.writer, self.timeout_s = reader, writer, timeout_s
        self.stats = TransferStats()
        self.have = 0
        self._started = time.monotonic()

    async def open(self, transfer_id: str, layout: KVLayout, token_ids: list[int]) -> int:
        await write_frame(
            self.writer, {"op": "open", "transfer": transfer_id, "layout": layout.to_json(), "tokens": token_ids}
        )
        self.have = int(str(await self._answer()))
        return self.have

    async def send(self, chunk: KVChunk) -> None:
        if chunk.end_block <= self.have:  # the receiver holds all of it
            self.stats.blocks_skipped += chunk.num_blocks
            return
        await write_frame(
            self.writer, {"op": "blocks", "first": chunk.first_block, "count": chunk.num_blocks}, chunk.data
        )
        self.stats.blocks_sent += chunk.num_blocks
        self.stats.bytes_sent += len(chunk.data)

    async def finish(self) -> int:
        await write_frame(self.writer, {"op": "done"})
        self.stats.held = int(str(await self._answer()))
        self.stats.seconds = time.monotonic() - self._started
        return self.stats.held

    async def _answer(self) -> object:
        header, _ = await read_frame(self.reader, self.timeout_s)
        if not header.get("ok"):
            raise TransferError(str(header.get("error") or "the receiver refused the transfer"), refused=True)
        return header.get("value", 0)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


class TcpKVSender:
    def __init__(self, connect_timeout_s: float = 5.0, timeout_s: float = 30.0) -> None:
        self.connect_timeout_s, self.timeout_s = connect_timeout_s, timeout_s

    async def connect(self, address: str) -> TcpKVSession:
        host, port = split_address(address)
        async with asyncio.timeout(self.connect_timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
        return TcpKVSession(reader, writer, self.timeout_s)


Importer = Callable[..., Awaitable[int]]  # (call, *args) -> leading blocks held: the engine's exchange()


@dataclass
class ReceiverStats:
    transfers: int = 0
    failed: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0


class TcpKVReceiver:
    """The decode replica's end: takes transfers and imports their blocks through `importer` (the engine's
    exchange calls: "cached_prefix", "import_chunk")."""

    def __init__(self, layout: KVLayout, importer: Importer, timeout_s: float = 30.0) -> None:
        self.layout, self.importer, self.timeout_s = layout, importer, timeout_s
        self.stats = ReceiverStats()
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listens; returns the port (an ephemeral one when `port` is 0)."""
        self.server = await asyncio.start_server(self._serve, host, port)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        started = time.monotonic()
        try:
            await self._transfer(reader, writer)
            self.stats.transfers += 1
        except (TransferError, ConnectionError, asyncio.IncompleteReadError, TimeoutError, ValueError) as e:
            self.stats.failed += 1
            log.warning("KV transfer from %s ended early: %s", writer.get_extra_info("peername"), e or type(e).__name__)
        finally:
            self.stats.seconds += time.monotonic() - started
            writer.close()

    async def _transfer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        header, _ = await read_frame(reader, self.timeout_s)
        if header.get("op") != "open":
            raise TransferError("a transfer starts with open")
        mismatch = self.layout.mismatch(KVLayout.from_json(dict(header["layout"])))  # type: ignore[call-overload]
        if mismatch is not None:
            await write_frame(writer, {"ok": False, "error": f"KV layouts differ: {mismatch}"})
            raise TransferError(f"refused: KV layouts differ: {mismatch}")
        token_ids = [int(t) for t in header["tokens"]]  # type: ignore[attr-defined]
        held = await self.importer("cached_prefix", token_ids)
        await write_frame(writer, {"ok": True, "value": held})
        while True:
            header, payload = await read_frame(reader, self.timeout_s)
            if header.get("op") == "done":
                await write_frame(writer, {"ok": True, "value": held})
                return
            chunk = KVChunk(int(str(header["first"])), int(str(header["count"])), payload)
            try:
                held = await self.importer("import_chunk", token_ids, chunk)
            except ValueError as e:
                await write_frame(writer, {"ok": False, "error": str(e)})
                raise TransferError(str(e)) from e
            self.stats.blocks += chunk.num_blocks
            self.stats.bytes += len(payload)
