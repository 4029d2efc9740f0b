"""The simulator's request record: one turn of one conversation, from arrival at a gateway to its last token."""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.engine.request import Request


@dataclass(eq=False, slots=True)
class SimRequest:
    rid: str
    tier: str
    tenant: str  # organisation
    user: str
    priority: int  # the engine's priority class (the tier's)
    prompt: list[int]
    output: list[int]  # the answer the model "generates", token by token
    hashes: list  # the engine's block keys of prompt + output, computed once by the workload
    arrival: float
    conversation: int = -1
    turn: int = 0
    cancel_after: float | None = None  # the client cancels this long after arriving (None: never)
    max_tokens: int = 0  # tokens it will generate: len(output), or less when the overload ladder caps it
    # what happened
    status: str = "pending"  # ok | cancelled | shed | quota | rejected
    admitted: float | None = None  # got its slot in the dispatcher (then routed and queued on a replica)
    first_token: float | None = None
    finished: float | None = None
    last_token: float = 0.0
    tokens_out: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    replica: str = ""
    req: Request | None = None
    slot: object = None  # the dispatcher's Slot
    reservation: object = None  # the quota's Reservation

    def __post_init__(self) -> None:
        if not self.max_tokens:
            self.max_tokens = len(self.output)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival
