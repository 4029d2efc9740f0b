"""The routing policies' former home, kept so that importers outside the router keep working (gateway/routing.py:
NoReplicaAvailable; sim/replica.py: ReplicaState; sim/config.py: POLICIES). New code imports from
tokenfleet.router.policies (the policies, their interface and factory) and tokenfleet.router.replica_state."""

from tokenfleet.router.policies import (
    POLICIES,
    CacheAwarePolicy,
    Choice,
    LeastLoadedPolicy,
    NoReplicaAvailable,
    RoundRobinPolicy,
    RoutingPolicy,
    healthy_replicas,
    make_policy,
)
from tokenfleet.router.replica_state import TOKENS_PER_SLOT, ReplicaState

__all__ = [
    "POLICIES",
    "TOKENS_PER_SLOT",
    "CacheAwarePolicy",
    "Choice",
    "LeastLoadedPolicy",
    "NoReplicaAvailable",
    "ReplicaState",
    "RoundRobinPolicy",
    "RoutingPolicy",
    "healthy_replicas",
    "make_policy",
]
