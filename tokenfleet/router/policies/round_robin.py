"""Each healthy replica in turn, ignoring load and cache: the baseline the other policies are measured against."""

from __future__ import annotations

from tokenfleet.router.policies.in_turn import InTurn


class RoundRobinPolicy(InTurn):
    reason = "round_robin"
