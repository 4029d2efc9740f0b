"""A cancellation that a client library swallows (redis-py does, now and then, when the cancel lands as a reply
arrives, and returns normally) still stops the relay and still ends a client's stream as a disconnect; a cancel
that lands before the relay's task has run still ends its stream. In a fleet every relay and every reader waits
in Redis calls, so before, most hang-ups and cancels were lost there and the engine generated to the end."""

from __future__ import annotations

import asyncio

from tokenfleet.gateway.chunks import Chunk
from tokenfleet.gateway.formats import OpenAIFormat
from tokenfleet.gateway.relay import Relay
from tokenfleet.gateway.resume import MemoryResumeBuffer, StreamEvent, read_all
from tokenfleet.gateway.sse_response import SSEResponse


class Swallows:
    """Swallows the first cancellation that lands in `wait` (later ones pass, so nothing can hang a test)."""

    swallowed = False

    async def wait(self, seconds: float) -> None:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            if self.swallowed:
                raise
            self.swallowed = True


class SwallowingBuffer(Swallows, MemoryResumeBuffer):
    """Each append takes a moment, and the first cancellation that comes meanwhile is swallowed."""

    async def append(self, request_id: str, event: StreamEvent) -> None:
        await self.wait(0.01)
        await super().append(request_id, event)


class Replica:
    """An endless stream of chunks; notes when it started and when it was closed."""

    def __init__(self) -> None:
        self.started = self.closed = False

    async def chunks(self):
        self.started = True
        try:
            while True:
                await asyncio.sleep(0)
                yield Chunk(
                    {
                        "id": "x",
                        "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {"content": "t"}, "finish_reason": None}],
                    }
                )
        finally:
            self.closed = True


def relay_on(buffer: MemoryResumeBuffer) -> Relay:
    return Relay("r", buffer, OpenAIFormat("r", include_usage=False), disconnect_grace_s=0.1)


async def ended(relay: Relay) -> bool:
    try:
        await asyncio.wait_for(relay.finished.wait(), 2)
    except TimeoutError:
        return False
    return True


def test_a_relay_stops_when_its_buffer_swallows_the_cancellation():
    async def main():
        relay, replica = relay_on(SwallowingBuffer()), Replica()
        await relay.start(replica.chunks())
        await asyncio.sleep(0.05)  # relaying: most of its time is spent in append
        assert relay.cancel("api")
        assert await ended(relay), "the relay went on after its cancellation was swallowed"
        assert replica.closed and relay.cancel_reason == "api"

    asyncio.run(main())


def test_a_relay_cancelled_before_it_ran_ends_its_stream_without_asking_a_replica():
    async def main():
        buffer, replica = MemoryResumeBuffer(), Replica()
        relay = relay_on(buffer)
        await relay.start(replica.chunks())
        assert relay.cancel("api")  # its task has not had a turn yet
        assert await ended(relay), "a relay cancelled before it ran never finished"
        events = [e async for e in read_all(buffer.follow("r", 0), 0.1)]
        assert [e.data for e in events] == ["[DONE]"] and not replica.started

    asyncio.run(main())


class SwallowingFollower(Swallows):
    """A reader of a stream with no events yet whose wait swallows a cancellation (as redis-py's XREAD can)."""

    async def next(self, wait_s: float) -> list[StreamEvent] | None:
        await self.wait(min(wait_s, 0.05))
        return []


def test_a_stream_ends_as_a_disconnect_when_its_reader_swallows_the_cancellation():
    async def main():
        endings: list[str] = []
        left = asyncio.Event()

        async def receive() -> dict:
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            pass

        response = SSEResponse(SwallowingFollower(), {}, 10.0, 10.0, endings.append)
        task = asyncio.create_task(response({"type": "http"}, receive, send))
        await asyncio.sleep(0.02)
        left.set()  # the client hangs up while the reader waits
        done, _ = await asyncio.wait({task}, timeout=2)
        task.cancel()  # a second cancellation is not swallowed: nothing is left running
        await asyncio.wait({task}, timeout=2)
        assert done and endings == ["disconnect"], f"the stream went on after the client left: {endings}"

    asyncio.run(main())
