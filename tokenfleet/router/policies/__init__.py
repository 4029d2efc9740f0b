"""Routing policies, SGLang's router's shape: one interface (base.RoutingPolicy), one file per policy, one factory
(factory.make_policy). cache_aware's parts have files of their own: the load bound and the conversations' homes."""

from tokenfleet.router.policies.base import Choice, NoReplicaAvailable, Placement, RoutingPolicy, healthy_replicas
from tokenfleet.router.policies.cache_aware import CacheAwarePolicy
from tokenfleet.router.policies.factory import POLICIES, make_policy
from tokenfleet.router.policies.least_loaded import LeastLoadedPolicy
from tokenfleet.router.policies.load_bound import LoadBound
from tokenfleet.router.policies.round_robin import RoundRobinPolicy

__all__ = [
    "POLICIES",
    "CacheAwarePolicy",
    "Choice",
    "LeastLoadedPolicy",
    "LoadBound",
    "NoReplicaAvailable",
    "Placement",
    "RoundRobinPolicy",
    "RoutingPolicy",
    "healthy_replicas",
    "make_policy",
]
