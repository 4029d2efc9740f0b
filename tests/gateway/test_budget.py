"""The budget guard on its own, over the in-memory quota: chunks pass while their usage is reserved (more is reserved
as they come), the first one its budget cannot cover ends the response for length and closes the replica's stream,
and a quota store that cannot answer never stops a request."""

from __future__ import annotations

import asyncio

from tokenfleet.gateway.admission import Admission, Admitted
from tokenfleet.gateway.budget import BudgetGuard, within_budget
from tokenfleet.gateway.chunks import Chunk
from tokenfleet.quota import Limits, MemoryQuota, QuotaUnavailable, Scope

PROMPT = 10


class Replica:
    """A stream of chunks, one token each, usage on every chunk, as our replicas send them; notes when closed."""

    def __init__(self, tokens: int, choices: int = 1, kind: str = "chat") -> None:
        self.tokens, self.choices, self.kind, self.closed = tokens, choices, kind, False

    async def chunks(self):
        try:
            for i in range(self.tokens):
                index = i % self.choices
                part = {"delta": {"content": f"t{i} "}} if self.kind == "chat" else {"text": f"t{i} "}
                yield Chunk.from_wire(
                    {
                        "id": "r",
                        "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                        "choices": [{"index": index, **part, "finish_reason": None}],
                        "usage": {"prompt_tokens": PROMPT, "completion_tokens": i + 1},
                    }
                )
        finally:
            self.closed = True


async def admitted_with(quota, tokens: int, **limits: int) -> tuple[Admission, Admitted]:
    scope = Scope("user:acme/1", "acme", Limits(**limits))
    decision = await quota.reserve("req-1", [scope], tokens)
    assert decision.allowed
    return Admission(quota, {}, None), Admitted("req-1", None, decision.reservation)


async def relayed(replica: Replica, admission: Admission, admitted: Admitted, choices: int = 1) -> list[dict]:
    chunks = within_budget(replica.chunks(), BudgetGuard(admission, admitted, step=8), choices)
    return [c.with_client_usage() async for c in chunks]


def test_a_response_stops_for_length_where_the_budget_ends():
    async def main():
        quota = MemoryQuota()
        admission, admitted = await admitted_with(quota, PROMPT + 5, tokens_per_day=PROMPT + 20)
        replica = Replica(100)
        out = await relayed(replica, admission, admitted)
        sent = [c for c in out if c["choices"] and c["choices"][0].get("delta", {}).get("content")]
        assert len(sent) == 20 and sent[-1]["usage"]["completion_tokens"] == 20
        assert out[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
        assert out[-1]["choices"] == [] and out[-1]["usage"]["completion_tokens"] == 20
        assert replica.closed, "the replica's stream was left open"
        assert admitted.reservation.tokens == PROMPT + 20
        await quota.reconcile(admitted.reservation, PROMPT + 20)
        left = await quota.remaining(admitted.reservation.scopes[0])
        assert left.tokens_today == 0

    asyncio.run(main())


def test_every_open_choice_ends_and_a_finished_one_is_left_alone():
    async def main():
        admission, admitted = await admitted_with(MemoryQuota(), PROMPT + 7, tokens_per_minute=PROMPT + 7)
        replica = Replica(100, choices=3, kind="text")

        async def with_choice_1_finished():
            async for chunk in replica.chunks():
                if chunk.choices[0]["index"] == 1:
                    chunk.choices[0]["finish_reason"] = "stop"
                yield chunk

        chunks = within_budget(with_choice_1_finished(), BudgetGuard(admission, admitted), 3)
        out = [c.with_client_usage() async for c in chunks]
        ends = out[-2]["choices"]
        assert [(c["index"], c["text"], c["finish_reason"]) for c in ends] == [(0, "", "length"), (2, "", "length")]
        assert out[-1]["usage"]["completion_tokens"] == 7

    asyncio.run(main())


def test_within_the_budget_nothing_changes_and_more_is_reserved_as_it_goes():
    async def main():
        admission, admitted = await admitted_with(MemoryQuota(), PROMPT + 5, tokens_per_day=10_000)
        out = await relayed(Replica(30), admission, admitted)
        assert len(out) == 30 and all(c["choices"][0]["finish_reason"] is None for c in out)
        assert admitted.reservation.tokens == PROMPT + 5 + 4 * 8  # in steps of 8, as the tokens passed 15

    asyncio.run(main())


class Unreachable(MemoryQuota):
    calls = 0

    async def extend(self, reservation, at_least, at_most):
        self.calls += 1
        raise QuotaUnavailable("quota store unavailable")


def test_a_quota_store_that_cannot_answer_does_not_stop_the_request():
    async def main():
        quota = Unreachable()
        admission, admitted = await admitted_with(quota, PROMPT + 5, tokens_per_day=PROMPT + 5)
        out = await relayed(Replica(30), admission, admitted)
        assert len(out) == 30
        assert quota.calls == 3  # at 16, 25 and 34 tokens: once a step (8) apart, not on every chunk

    asyncio.run(main())
