"""Keeps a running request inside its tenant's token budgets. A request without max_tokens reserves only its
tenant's typical output at admission, yet may generate to the end of the context window; ten such requests at
once used 7.6 times a daily budget. So while it streams, whenever the tokens it has used (prompt + output, from the
usage the replica sends on every chunk) pass what it has reserved, it reserves up to EXTEND_TOKENS more, in every
scope at once (daily budget and tokens-per-minute bucket, one atomic quota call). When its scopes have no room for
the chunk at hand, the request stops there: that chunk is dropped, the open choices end with finish_reason
"length", and closing the replica's stream aborts the engine request.

The bound: what a scope's requests are sent and charged never exceeds its budget, since every token is reserved
before it is sent and reservations never exceed the budget (per minute: the bucket's size plus its refill). Past
that, the engine computes only the tokens of a stopped request that it generates before the closed stream reaches
it, a few decode steps; they are neither sent nor charged. Not covered: a quota store outage (requests go on and
their reconcile charges what they used, as before) and replicas that send no usage on each chunk."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from tokenfleet.api.usage import Usage
from tokenfleet.gateway.admission import Admission, Admitted
from tokenfleet.gateway.chunks import Chunk, Piece

EXTEND_TOKENS = 64  # how much more a request reserves at a time: a quota call per this many tokens


class BudgetGuard:
    def __init__(self, admission: Admission, admitted: Admitted, step: int = EXTEND_TOKENS) -> None:
        self.admission, self.admitted, self.step = admission, admitted, step
        self._unchecked_until = 0  # while the quota store cannot answer: tokens let through without a reservation

    async def covers(self, used: int) -> bool:
        """Whether `used` tokens are reserved, reserving more first when they are not yet."""
        reserved = self.admitted.reservation.tokens
        if used <= max(reserved, self._unchecked_until):
            return True
        missing = used - reserved
        granted = await self.admission.extend(self.admitted, missing, max(self.step, missing))
        if granted is None:  # the store cannot tell: go on, and ask again a step later
            self._unchecked_until = used + self.step
            return True
        return granted


async def within_budget(chunks: AsyncIterator[Piece], guard: BudgetGuard, choices: int) -> AsyncIterator[Piece]:
    """`chunks` as long as their usage is reserved; then the closing chunks of a response cut for length."""
    covered: Usage | None = None  # the usage of the last chunk passed on: what the request is charged
    finished: set[int] = set()
    async with aclosing(chunks):
        async for chunk in chunks:
            if not isinstance(chunk, Chunk):
                yield chunk
                continue
            usage = chunk.usage
            if usage is not None and not await guard.covers(usage.total_tokens):
                for closing in _cut_for_length(chunk.data, covered, choices, finished):
                    yield closing
                return
            covered = usage or covered
            finished.update(c["index"] for c in chunk.choices if c.get("finish_reason"))
            yield chunk


def _cut_for_length(template: dict, usage: Usage | None, choices: int, finished: set[int]) -> list[Chunk]:
    """The chunk that ends every open choice with finish_reason "length", then the usage chunk."""
    head = {k: template[k] for k in ("id", "object", "created", "model") if k in template}
    chat = template.get("object") == "chat.completion.chunk"
    ends = [
        {"index": i, "delta": {}, "logprobs": None, "finish_reason": "length"}
        if chat
        else {"index": i, "text": "", "logprobs": None, "finish_reason": "length"}
        for i in range(choices)
        if i not in finished
    ]
    out = [Chunk({**head, "choices": ends}, usage)] if ends else []
    if usage is not None:
        out.append(Chunk({**head, "choices": []}, usage))
    return out
