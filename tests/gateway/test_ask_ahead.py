"""A replica asked while the quota decides (issue 25: the reservation's round trip off the path to the first
token). Only a caller whose last admitted request left ample room, whose tenant was not refused lately, with no
safety hook and a free slot, is asked ahead; a refused one's replica stream is stopped, the client gets the 429 and
nothing else, no stream stays in the resume buffer, and the tenant is checked first from then on."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.gateway.inprocess import inprocess_gateway
from tests.gateway.test_admission import content_chunk, usage_chunk
from tokenfleet.dispatch.queue import Dispatcher
from tokenfleet.dispatch.tickets import Ticket
from tokenfleet.dispatch.tiers import TierConfig
from tokenfleet.gateway.app import create_gateway_app
from tokenfleet.gateway.gateway import Gateway
from tokenfleet.quota.base import Decision
from tokenfleet.quota.memory import MemoryQuota

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 4}
ROOM = {"x-ratelimit-remaining-requests": "100", "x-ratelimit-remaining-tokens": "100000"}


class SlowQuota(MemoryQuota):
    """Answers after a Redis-like wait; `answers` says, per call, allow (with these headers) or refuse."""

    def __init__(self, answers: list[dict | None], delay_s: float = 0.05) -> None:
        super().__init__()
        self.answers, self.delay_s, self.answered_at, self.reconciled = list(answers), delay_s, [], []

    async def reserve(self, request_id, scopes, tokens, tier="default"):
        await asyncio.sleep(self.delay_s)
        headers = self.answers.pop(0)
        self.answered_at.append(time.monotonic())
        if headers is None:
            return Decision(False, None, reason="tokens_per_minute", scope=scopes[0].name, retry_after_s=1.0)
        decision = await super().reserve(request_id, scopes, tokens, tier)
        return Decision(True, decision.reservation, headers=headers)

    async def reconcile(self, reservation, used_tokens):
        self.reconciled.append((reservation.request_id, used_tokens))
        await super().reconcile(reservation, used_tokens)


class TimedUpstream:
    """A replica that notes when each request reached it and whether its stream was closed before the end."""

    name = "timed"
    kind = "tokenfleet"

    def __init__(self, count: int = 4, per_token_s: float = 0.0) -> None:
        self.count, self.per_token_s = count, per_token_s
        self.asked_at: list[float] = []
        self.stopped: list[int] = []  # tokens sent before a stream was closed early
        self.stopped_at: list[float] = []

    async def stream(self, kind: str, body: dict):
        self.asked_at.append(time.monotonic())
        sent = 0
        try:
            for i in range(self.count):
                await asyncio.sleep(self.per_token_s)
                sent += 1
                yield content_chunk(i)
            yield usage_chunk(sent)
        except (GeneratorExit, asyncio.CancelledError):
            self.stopped.append(sent)
            self.stopped_at.append(time.monotonic())
            raise

    async def load(self) -> dict:
        return {"queued_prefill_tokens": 0}


class GatedQuota(SlowQuota):
    """Allows every request, with room to spare; the reservation whose turn (0, 1, ...) has an event in `gates`
    answers only once that event is set (`waiting` is set meanwhile)."""

    def __init__(self, gates: dict[int, asyncio.Event]) -> None:
        super().__init__([ROOM] * 8, delay_s=0.0)
        self.gates, self.calls, self.waiting = gates, 0, asyncio.Event()

    async def reserve(self, request_id, scopes, tokens, tier="default"):
        gate = self.gates.get(self.calls)
        self.calls += 1
        if gate is not None:
            self.waiting.set()
            await gate.wait()
        return await super().reserve(request_id, scopes, tokens, tier)


class HeldUpstream(TimedUpstream):
    """A replica whose streams are told apart: the n-th stream of prompt p says `p<n>:t0`, `p<n>:t1`, ...; the first
    stream of a prompt with an event in `held` stops after its first token until that event is set. `log` has what
    happened to each stream, in order: asked, then ended or stopped (closed before its end)."""

    def __init__(self, held: dict[str, asyncio.Event]) -> None:
        super().__init__()
        self.held, self.log, self.streams = held, [], {}

    async def stream(self, kind: str, body: dict):
        prompt = body["messages"][0]["content"]
        self.streams[prompt] = self.streams.get(prompt, 0) + 1
        name, hold = f"{prompt}{self.streams[prompt]}", self.held.pop(prompt, None)
        self.log.append(("asked", name))
        sent = 0
        try:
            for i in range(self.count):
                chunk = content_chunk(i)
                chunk["choices"][0]["delta"]["content"] = f"{name}:t{i}"
                sent += 1
                yield chunk
                if hold is not None:
                    await hold.wait()
                    hold = None
            yield usage_chunk(sent)
        except (GeneratorExit, asyncio.CancelledError):
            self.log.append(("stopped", name))
            raise
        self.log.append(("ended", name))


class UsageLog:
    """Stands in for the usage recorder: the requests whose usage rows were opened, and their final events."""

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.closed: list = []

    def started(self, request_id: str, snapshot) -> None:
        self.opened.append(request_id)

    def finished(self, event) -> None:
        self.closed.append(event)


def ahead_gateway(demo_model_dir, quota, upstream, ask_ahead: bool = True, **options) -> Gateway:
    gw = inprocess_gateway(demo_model_dir, [upstream], open_tier="paid", quota=quota, **options)
    gw.admission.ask_ahead = ask_ahead
    return gw


async def post_all(gw: Gateway, count: int) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=create_gateway_app(gw))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return [await client.post("/v1/chat/completions", json=CHAT) for _ in range(count)]


async def until(condition, timeout_s: float = 10.0) -> None:
    """Waits for a state of the gateway (not for a time): fails if it is not reached within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("the gateway never got there")
        await asyncio.sleep(0.001)


def test_a_caller_with_room_has_its_replica_asked_before_the_quota_answers(demo_model_dir):
    quota, upstream = SlowQuota([ROOM, ROOM, ROOM]), TimedUpstream()
    responses = asyncio.run(post_all(ahead_gateway(demo_model_dir, quota, upstream), 3))
    for r in responses:
        assert r.status_code == 200, r.text
        assert "".join(_contents(r.text)) == "t0t1t2t3"
        assert r.text.rstrip().endswith("data: [DONE]")
    # the first request has no room on record: the quota first; the next ones overlap it
    assert upstream.asked_at[0] > quota.answered_at[0]
    assert upstream.asked_at[1] < quota.answered_at[1] - 0.03
    assert upstream.asked_at[2] < quota.answered_at[2] - 0.03
    assert upstream.stopped == []
    assert [used for _, used in quota.reconciled] == [9, 9, 9]


def test_off_the_replica_is_asked_only_after_the_quota(demo_model_dir):
    quota, upstream = SlowQuota([ROOM, ROOM]), TimedUpstream()
    asyncio.run(post_all(ahead_gateway(demo_model_dir, quota, upstream, ask_ahead=False), 2))
    assert all(asked > answered for asked, answered in zip(upstream.asked_at, quota.answered_at, strict=True))


@pytest.mark.parametrize(
    "headers",
    [
        {"x-ratelimit-remaining-requests": "1", "x-ratelimit-remaining-tokens": "100000"},
        {"x-ratelimit-remaining-requests": "100", "x-ratelimit-remaining-tokens": "20"},
    ],
    ids=["one request left", "tokens for one more"],
)
def test_a_caller_near_its_limits_is_checked_first(demo_model_dir, headers):
    quota, upstream = SlowQuota([headers, headers]), TimedUpstream()
    asyncio.run(post_all(ahead_gateway(demo_model_dir, quota, upstream), 2))
    assert upstream.asked_at[1] > quota.answered_at[1]


def test_a_refused_request_asked_ahead_is_stopped_and_its_tenant_checked_first_after(demo_model_dir):
    quota = SlowQuota([ROOM, None, ROOM, ROOM], delay_s=0.1)
    upstream = TimedUpstream(count=50, per_token_s=0.01)  # still generating when the refusal comes
    gw = ahead_gateway(demo_model_dir, quota, upstream)
    first, refused, after, again = asyncio.run(post_all(gw, 4))
    assert first.status_code == 200 and after.status_code == 200 and again.status_code == 200
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["type"] == "requests"  # OpenAI's shape for a rate limit
    assert "data:" not in refused.text
    assert upstream.asked_at[1] < quota.answered_at[1]  # it was asked ahead...
    assert len(upstream.stopped) == 1 and upstream.stopped[0] < 50  # ...and stopped there, at once
    assert upstream.stopped_at[0] < upstream.asked_at[2]
    assert upstream.asked_at[2] > quota.answered_at[2] and upstream.asked_at[3] > quota.answered_at[3]
    assert len(quota.reconciled) == 3  # the refused one held nothing
    assert not gw.buffer._logs or set(gw.buffer._logs) <= {r.headers["x-request-id"] for r in (first, after, again)}


def test_a_request_asked_ahead_that_finds_the_pool_full_is_stopped_and_asked_again_once_it_has_a_slot(
    demo_model_dir,
):
    # b is asked ahead while the pool's one slot is free; its reservation answers only after c took that slot
    quota_answers, c_may_end = asyncio.Event(), asyncio.Event()
    quota = GatedQuota({1: quota_answers})  # reservations: a, b, c
    upstream = HeldUpstream({"b": asyncio.Event(), "c": c_may_end})  # b's first stream is never let go on
    gw = ahead_gateway(demo_model_dir, quota, upstream)
    usage = gw.usage = UsageLog()
    dispatcher = gw.admission.dispatchers["tiny"]
    dispatcher.set_slots(1)
    asked_ahead, ask_ahead = [], gw._ask_ahead  # kept alive: the gateway must close b's stream itself, not the GC

    def keep_asked_ahead(*args):
        ahead = ask_ahead(*args)
        asked_ahead.extend([ahead] if ahead is not None else [])
        return ahead

    gw._ask_ahead = keep_asked_ahead

    async def main() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=create_gateway_app(gw))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:

            def post(prompt: str) -> asyncio.Future[httpx.Response]:
                body = {**CHAT, "messages": [{"role": "user", "content": prompt}]}
                return asyncio.ensure_future(client.post("/v1/chat/completions", json=body))

            a = await post("a")  # no room on record yet: the quota first; it leaves room for the next ones
            await until(lambda: dispatcher.snapshot().in_use == 0)
            b = post("b")
            await until(lambda: ("asked", "b1") in upstream.log and quota.waiting.is_set())  # asked ahead
            c = post("c")
            await until(lambda: ("asked", "c1") in upstream.log and dispatcher.snapshot().in_use == 1)
            assert len(asked_ahead) == 2  # b's and c's
            quota_answers.set()  # b is admitted, and finds the pool full
            await until(lambda: ("stopped", "b1") in upstream.log)
            await until(lambda: dispatcher.snapshot().queued == 1)
            for _ in range(100):  # however long c holds its slot, b waits its turn, asked nothing more
                await asyncio.sleep(0)
            assert not b.done() and upstream.streams["b"] == 1 and len(gw.relays) == 2  # a's and c's
            assert dispatcher.snapshot().in_use == 1 and dispatcher.snapshot().queued == 1
            c_may_end.set()
            responses = a, await b, await c
            await until(lambda: len(quota.reconciled) == 3 and len(usage.closed) == 3 and not gw._background)
        return responses

    a, b, c = asyncio.run(main())
    for r, name in ((a, "a1"), (b, "b2"), (c, "c1")):
        assert r.status_code == 200, r.text
        assert "".join(_contents(r.text)) == "".join(f"{name}:t{i}" for i in range(4))
        assert r.text.rstrip().endswith("data: [DONE]") and r.text.count("[DONE]") == 1
        assert "b1:" not in r.text  # nothing of the stream asked ahead reached a client
    assert upstream.log == [
        ("asked", "a1"),
        ("ended", "a1"),
        ("asked", "b1"),  # ahead of its reservation
        ("asked", "c1"),  # c takes the last slot meanwhile
        ("stopped", "b1"),  # b is admitted into a full pool: its early stream is closed
        ("ended", "c1"),  # c's slot is freed...
        ("asked", "b2"),  # ...and only then is the replica asked again for b
        ("ended", "b2"),
    ]
    b_id = b.headers["x-request-id"]
    assert [used for request_id, used in quota.reconciled if request_id == b_id] == [9]  # reconciled once
    assert usage.opened.count(b_id) == 1
    [billed] = [event for event in usage.closed if event.request_id == b_id]  # one usage record, the served one
    assert billed.status == "finished" and billed.output_tokens == 4 and billed.replica == "timed"


def test_no_request_is_asked_ahead_when_a_safety_hook_must_see_it(demo_model_dir):
    async def hook(body: dict, prompt_token_ids: list[int]) -> str | None:
        return None

    quota, upstream = SlowQuota([ROOM, ROOM]), TimedUpstream()
    gw = ahead_gateway(demo_model_dir, quota, upstream)
    gw.safety = hook
    asyncio.run(post_all(gw, 2))
    assert upstream.asked_at[1] > quota.answered_at[1]


def test_the_dispatcher_grants_at_once_only_with_a_free_slot_in_a_serving_tier():
    tiers = {"paid": TierConfig(priority=0, weight=1), "free": TierConfig(priority=1, weight=1)}
    dispatcher = Dispatcher(tiers, slots=1)

    async def main() -> None:
        assert dispatcher.grants_at_once("paid")
        slot = await dispatcher.acquire(Ticket("a", "t", "paid", 10))
        assert not dispatcher.grants_at_once("paid")
        dispatcher.release(slot)
        dispatcher.pause("free")
        assert dispatcher.grants_at_once("paid") and not dispatcher.grants_at_once("free")
        assert not dispatcher.grants_at_once("nonexistent")

    asyncio.run(main())


def _contents(text: str) -> list[str]:
    import json

    out = []
    for line in text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                out.append(choice.get("delta", {}).get("content") or "")
    return out
