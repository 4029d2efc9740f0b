"""Priority, not quota: who goes first when a model's pool is full (queue.py), and what to give up, in a fixed
order, when it stays full (overload.py)."""

from tokenfleet.dispatch.overload import LoadSignal, OverloadLadder, OverloadSettings, Plan, projected_ttft_s
from tokenfleet.dispatch.queue import Dispatcher
from tokenfleet.dispatch.tickets import DispatchSnapshot, Slot, Ticket, TierSnapshot

__all__ = [
    "Dispatcher",
    "DispatchSnapshot",
    "LoadSignal",
    "OverloadLadder",
    "OverloadSettings",
    "Plan",
    "Slot",
    "Ticket",
    "TierSnapshot",
    "projected_ttft_s",
]
