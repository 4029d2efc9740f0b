"""A replica's part in disaggregated prefill/decode (`tokenfleet replica --role prefill | decode | both`).

A decode replica listens for KV transfers (replica/kv_transport.py) and says where, and in what layout, at
GET /internal/kv/info. A prefill replica, asked at POST /internal/kv/prefill to prefill a prompt for a decode
replica (the gateway names it), computes the prompt with its engine and sends each chunk's blocks as the chunk
finishes, then answers once the decode replica holds them; the gateway then sends the request to the decode
replica, whose prefix cache has the prompt. Which side computes what is the engine's (engine/kv_exchange.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client.core import CounterMetricFamily, Metric

from tokenfleet.api.errors import APIError
from tokenfleet.api.http import within_lifespan
from tokenfleet.engine.kv_transfer import KVLayout
from tokenfleet.engine.request import SamplingParams
from tokenfleet.replica.kv_transport import KVSender, TcpKVReceiver, TcpKVSender, TransferError, TransferStats

log = logging.getLogger(__name__)
ROLES = ("both", "prefill", "decode")
PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, kv_export=True)


@dataclass(frozen=True)
class KVRole:
    """What this replica does in a disaggregated pool, and where it takes KV transfers (decode)."""

    role: str = "both"
    kv_host: str = "127.0.0.1"  # listen address of the KV receiver
    kv_port: int = 0  # 0: an ephemeral port, advertised at /internal/kv/info
    advertise_host: str = "127.0.0.1"  # the host other replicas reach the receiver at

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")

    @property
    def receives(self) -> bool:
        return self.role == "decode"

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")


def check_role(role: KVRole, engine: Any) -> None:
    """A prefill or decode replica whose engine cannot move KV blocks fails at start, saying why."""
    if role.role != "both" and engine.kv_layout is None:
        raise ValueError(f"--role {role.role}: this engine cannot send or take KV blocks: {engine.kv_transfer_refusal}")


class PrefillService:
    def __init__(self, engine: Any, sender: KVSender | None = None) -> None:
        self.engine = engine
        self.sender = sender or TcpKVSender()
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        self.peers: dict[str, tuple[str, KVLayout]] = {}  # decode replica URL -> (KV address, layout)
        self.totals = TransferStats()
        self.failures = 0

    async def peer(self, url: str) -> tuple[str, KVLayout]:
        """A decode replica's KV address and layout (asked once per replica), refused when its layout differs."""
        known = self.peers.get(url)
        if known is None:
            try:
                response = await self.http.get(url.rstrip("/") + "/internal/kv/info")
                info = response.json()
                if not info.get("address"):
                    raise ValueError(f"it takes no KV transfers (role {info.get('role')})")
                known = (str(info["address"]), KVLayout.from_json(info["layout"]))
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                raise _failed(f"decode replica {url} gave no KV address: {e.__class__.__name__}: {e}") from e
            self.peers[url] = known
        mismatch = self.engine.kv_layout.mismatch(known[1])
        if mismatch is not None:
            raise APIError(
                409,
                f"decode replica {url} cannot take this replica's KV blocks: {mismatch}",
                "invalid_request_error",
                code="kv_layout_mismatch",
            )
        return known

    async def prefill(self, token_ids: list[int], peer_url: str, request_id: str | None = None) -> TransferStats:
        """Computes the prompt's KV and sends the blocks the decode replica lacks; returns once it holds them."""
        address, _ = await self.peer(peer_url)
        request_id = request_id or f"kv-{uuid.uuid4().hex}"
        try:
            session = await self.sender.connect(address)
        except (OSError, TimeoutError, TransferError) as e:
            self.failures += 1
            self.peers.pop(peer_url, None)  # a restarted decode replica listens on a new port: ask it again next time
            raise _failed(f"cannot reach decode replica {peer_url} at {address}: {e}") from e
        try:
            return await self._transfer(session, token_ids, request_id)
        except TransferError as e:
            self.failures += 1
            raise _failed(f"KV transfer to {peer_url} failed: {e}", refused=e.refused) from e
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
            self.failures += 1
            raise _failed(f"KV transfer to {peer_url} broke off: {e.__class__.__name__}: {e}") from e
        finally:
            await session.close()

    async def _transfer(self, session: Any, token_ids: list[int], request_id: str) -> TransferStats:
        have = await session.open(request_id, self.engine.kv_layout, token_ids)
        usable = (len(token_ids) - 1) // self.engine.kv_layout.block_size
        if have < usable:  # else the decode replica holds the whole prompt already: nothing to compute or send
            async for out in self.engine.generate(token_ids, PREFILL_ONLY, request_id=f"{request_id}-prefill"):
                if out.kv_chunk is not None:
                    await session.send(out.kv_chunk)
        else:
            session.stats.blocks_skipped = usable
        await session.finish()
        stats: TransferStats = session.stats
        self._count(stats)
        return stats

    def _count(self, stats: TransferStats) -> None:
        totals = self.totals
        totals.blocks_sent += stats.blocks_sent
        totals.bytes_sent += stats.bytes_sent
        totals.blocks_skipped += stats.blocks_skipped
        totals.seconds += stats.seconds

    async def aclose(self) -> None:
        await self.http.aclose()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """For the app's lifespan: the client to decode replicas closes with the server."""
        try:
            yield
        finally:
            await self.aclose()


def _failed(message: str, refused: bool = False) -> APIError:
    """The decode replica refused (409) or failed (424, Failed Dependency: this replica is fine, so the gateway's
    health tracking does not count it against it)."""
    if refused:
        return APIError(409, message, "invalid_request_error", code="kv_transfer_refused")
    return APIError(424, message, "server_error", code="kv_transfer_failed")


def attach_receiver(app: FastAPI, role: KVRole, engine: Any) -> TcpKVReceiver:
    """A decode replica's KV receiver, listening for as long as the app's lifespan runs."""
    receiver = TcpKVReceiver(engine.kv_layout, engine.exchange)

    @contextlib.asynccontextmanager
    async def listening() -> AsyncIterator[None]:
        port = await receiver.start(role.kv_host, role.kv_port)
        app.state.kv_address = f"{role.advertise_host}:{port}"
        log.info("decode replica: KV transfers on %s", app.state.kv_address)
        try:
            yield
        finally:
            await receiver.stop()

    within_lifespan(app, listening)
    return receiver


class KVTransferCollector:
    """The replica's KV transfer counters, both directions, for /metrics."""

    def __init__(self, model_name: str, prefill: PrefillService | None, receiver: TcpKVReceiver | None) -> None:
        self.model_name, self.prefill, self.receiver = model_name, prefill, receiver

    def collect(self) -> Iterator[Metric]:
        families = {
            "bytes": CounterMetricFamily("tokenfleet:kv_transfer_bytes", "KV block bytes moved.", labels=LABELS),
            "blocks": CounterMetricFamily("tokenfleet:kv_transfer_blocks", "KV blocks moved.", labels=LABELS),
            "seconds": CounterMetricFamily(
                "tokenfleet:kv_transfer_seconds", "Time transfers took, open to done.", labels=LABELS
            ),
            "failed": CounterMetricFamily(
                "tokenfleet:kv_transfers_failed", "Transfers that broke off or were refused.", labels=LABELS
            ),
        }
        if self.prefill is not None:
            sent = self.prefill.totals
            self._add(families, "sent", sent.bytes_sent, sent.blocks_sent, sent.seconds, self.prefill.failures)
        if self.receiver is not None:
            got = self.receiver.stats
            self._add(families, "received", got.bytes, got.blocks, got.seconds, got.failed)
        return iter(families.values())

    def _add(self, families: dict[str, CounterMetricFamily], direction: str, *values: float) -> None:
        for family, value in zip(families.values(), values):
            family.add_metric([self.model_name, direction], value)


LABELS = ["model_name", "direction"]


def transfer_answer(stats: TransferStats, started: float) -> dict[str, object]:
    return {
        "blocks_sent": stats.blocks_sent,
        "blocks_skipped": stats.blocks_skipped,
        "bytes_sent": stats.bytes_sent,
        "held": stats.held,
        "seconds": round(time.monotonic() - started, 6),
    }
