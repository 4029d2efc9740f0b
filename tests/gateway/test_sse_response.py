"""The SSE response on its own, driven like an ASGI server would: one task per stream (plus the idle disconnect
watcher) whatever happens on it, heartbeats while idle, a send timeout and a lag limit for slow readers, and how it
tells its owner the stream ended."""

from __future__ import annotations

import asyncio

from tokenfleet.gateway.resume import MemoryResumeBuffer, StreamEvent
from tokenfleet.gateway.sse_response import SSEResponse


class Client:
    """The ASGI side: what was sent, a send that can block, and a disconnect on demand."""

    def __init__(self, block_sends_after: int | None = None) -> None:
        self.bodies: list[bytes] = []
        self.started = asyncio.Event()
        self.left = asyncio.Event()
        self.block_sends_after = block_sends_after

    async def receive(self) -> dict:
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started.set()
            return
        if self.block_sends_after is not None and len(self.bodies) >= self.block_sends_after:
            await asyncio.Event().wait()  # a reader that stopped reading: its socket buffer is full
        self.bodies.append(message["body"])

    @property
    def text(self) -> str:
        return b"".join(self.bodies).decode()


def respond(
    buffer: MemoryResumeBuffer,
    client: Client,
    endings: list,
    ping_s: float = 10.0,
    send_timeout_s: float = 10.0,
    behind=None,
) -> asyncio.Task:
    response = SSEResponse(buffer.follow("r", 0), {}, ping_s, send_timeout_s, endings.append, behind)
    return asyncio.create_task(response({"type": "http"}, client.receive, client.send))


def counting_tasks(loop: asyncio.AbstractEventLoop) -> list:
    created = []

    def factory(loop, coro, **kwargs):
        task = asyncio.Task(coro, loop=loop, **kwargs)
        created.append(task)
        return task

    loop.set_task_factory(factory)
    return created


def test_one_task_streams_events_and_pings_and_completes():
    async def scenario():
        buffer, client, endings = MemoryResumeBuffer(), Client(), []
        await buffer.open("r")
        created = counting_tasks(asyncio.get_running_loop())
        task = respond(buffer, client, endings, ping_s=0.05)
        await asyncio.sleep(0.22)  # idle: heartbeats only
        pings = client.text.count(": ping\n\n")
        for i in range(1, 51):
            await buffer.append("r", StreamEvent(i, f"e{i}"))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        await buffer.close("r")
        await asyncio.wait_for(task, 2)
        assert 3 <= pings <= 5, client.text
        assert [line for line in client.text.splitlines() if line.startswith("id: ")] == [
            f"id: {i}" for i in range(1, 51)
        ]
        assert client.bodies[-1] == b"", "the response ends with an empty last body"
        assert endings == ["complete"]
        assert len(created) == 2, "the response's own task and its disconnect watcher, nothing per event or ping"

    asyncio.run(scenario())


def test_pings_keep_coming_while_events_are_sparse():
    async def scenario():
        buffer, client, endings = MemoryResumeBuffer(), Client(), []
        await buffer.open("r")
        task = respond(buffer, client, endings, ping_s=0.1)
        for i in range(1, 4):
            await asyncio.sleep(0.25)
            await buffer.append("r", StreamEvent(i, f"e{i}"))
        await buffer.close("r")
        await asyncio.wait_for(task, 2)
        text = client.text
        assert text.count(": ping\n\n") >= 4 and "data: e3" in text and endings == ["complete"]
        assert ": ping\n\nid: 1\n" in text, "a ping while waiting for the first event"

    asyncio.run(scenario())


def test_a_reader_that_stops_reading_is_cut_off_after_the_send_timeout():
    async def scenario():
        buffer, client, endings = MemoryResumeBuffer(), Client(block_sends_after=2), []
        await buffer.open("r")
        task = respond(buffer, client, endings, send_timeout_s=0.2)
        for i in range(1, 6):
            await buffer.append("r", StreamEvent(i, f"e{i}"))
            await asyncio.sleep(0.01)
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(task, 2)
        assert endings == ["slow"] and len(client.bodies) == 2
        assert asyncio.get_running_loop().time() - started < 0.5
        assert not task.cancelled()

    asyncio.run(scenario())


def test_a_reader_too_far_behind_is_cut_off_at_the_lag_limit():
    async def scenario():
        buffer, client, endings = MemoryResumeBuffer(), Client(), []
        await buffer.open("r")
        latest = [0]
        task = respond(buffer, client, endings, behind=lambda event_id: latest[0] - event_id > 5)
        for i in range(1, 4):  # the reader keeps up
            latest[0] = i
            await buffer.append("r", StreamEvent(i, f"e{i}"))
            await asyncio.sleep(0.01)
        for i in range(4, 20):  # a burst it cannot have read yet: 15 events behind the newest
            latest[0] = i
            await buffer.append("r", StreamEvent(i, f"e{i}"))
        await asyncio.wait_for(task, 2)
        assert endings == ["slow"]
        assert "data: e3" in client.text and "data: e4" not in client.text

    asyncio.run(scenario())


def test_a_disconnect_ends_an_idle_stream_at_once():
    async def scenario():
        buffer, client, endings = MemoryResumeBuffer(), Client(), []
        await buffer.open("r")
        task = respond(buffer, client, endings, ping_s=30)
        await client.started.wait()
        await asyncio.sleep(0.05)
        client.left.set()
        await asyncio.wait_for(task, 1)
        assert endings == ["disconnect"] and not task.cancelled()
        assert task.cancelling() == 0, "the watcher's cancellation was consumed, not left pending"
        assert buffer._logs["r"].waiters == [], "nothing left waiting on the buffer"

    asyncio.run(scenario())


def test_cancelled_from_outside_it_stays_cancelled():
    async def scenario():
        buffer, client, endings = MemoryResumeBuffer(), Client(), []
        await buffer.open("r")
        task = respond(buffer, client, endings)
        await client.started.wait()
        task.cancel()  # the server shutting down, not the client leaving
        done, _ = await asyncio.wait({task}, timeout=1)
        assert done and task.cancelled() and endings == ["error"]

    asyncio.run(scenario())
