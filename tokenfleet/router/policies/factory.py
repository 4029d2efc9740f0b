"""The one factory of routing policies, for the gateway's router and the fleet simulator alike."""

from __future__ import annotations

from tokenfleet.router.policies.base import RoutingPolicy
from tokenfleet.router.policies.cache_aware import CacheAwarePolicy
from tokenfleet.router.policies.least_loaded import LeastLoadedPolicy
from tokenfleet.router.policies.load_bound import DEFAULT_ABSOLUTE
from tokenfleet.router.policies.round_robin import RoundRobinPolicy

POLICIES = ("cache_aware", "least_loaded", "round_robin")


def make_policy(name: str, block_size: int, load_bound: float, load_slack: float = DEFAULT_ABSOLUTE) -> RoutingPolicy:
    """`load_bound` and `load_slack`: the relative and absolute slack of the load bound (cache_aware only)."""
    if name == "cache_aware":
        return CacheAwarePolicy(block_size=block_size, load_bound=load_bound, load_slack=load_slack)
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")
