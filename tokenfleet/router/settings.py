"""`routing:` in fleet.yaml: the policy and its load bound, health checks, product rules, canaries and shadows.

The load bound (cache_aware): a request goes where its conversation lives or its prefix is cached unless that replica
is really busier than the least loaded one, which takes both of (counting the request, in sequences: the router's
live in-flight count, other gateways' sequences from the last load report, queued prefill / 2048 tokens)
- more than `load_slack` sequences above the least loaded (absolute: small counts never look imbalanced), and
- more than `load_bound` times the least loaded (relative: large counts do not drift apart).
SGLang's router has the same pair (balance_abs_threshold, balance_rel_threshold), counted in requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.router.catalog import RoutingRule
from tokenfleet.router.health import HealthSettings
from tokenfleet.router.policies import POLICIES
from tokenfleet.router.policies.load_bound import DEFAULT_ABSOLUTE, DEFAULT_RELATIVE
from tokenfleet.settings import section


@dataclass
class Canary:
    """A share of the requests for `model` (a version or an alias) goes to the `version` under test, per tier."""

    model: str
    version: str
    percent: dict[str, float] = field(default_factory=dict)  # tier -> percent; "default" for the others

    def share(self, tier: str) -> float:
        return self.percent.get(tier, self.percent.get("default", 0.0)) / 100.0


@dataclass
class Shadow:
    """A copy of `percent`% of the requests for `model` also goes to `candidate`; its output is discarded and its
    latency recorded beside the primary's."""

    model: str
    candidate: str
    percent: float = 100.0


@dataclass
class RoutingSettings:
    policy: str = "cache_aware"
    load_bound: float = DEFAULT_RELATIVE  # relative slack: passed over only above this x the least loaded ...
    load_slack: float = DEFAULT_ABSOLUTE  # ... and more than this many sequences above it (see the docstring)
    block_size: int = 16  # must match the replicas' engine block size for prefix hashes to agree
    load_interval_s: float = 1.0
    max_retries: int = 2  # a replica dying mid-response: the request continues on another, this many times
    replica_timeout_s: float = 30.0  # longest wait for a replica's next byte: a hung replica fails the attempt
    # disaggregated pools: a prompt with fewer tokens than this beyond what the decode replica has cached (as far
    # as this router knows) is prefilled by the decode replica itself: moving its KV would cost more than it saves
    remote_prefill_min_tokens: int = 64
    register_prefix: str = "tokenfleet:replicas:"  # the Redis replica registry (when the fleet has redis_url)
    health: HealthSettings = field(default_factory=HealthSettings)
    rules: dict[str, list[RoutingRule]] = field(default_factory=dict)  # routing alias -> its rules
    canary: list[Canary] = field(default_factory=list)
    shadow: list[Shadow] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not (self.load_bound >= 1.0 and self.load_slack >= 0) or self.block_size < 1 or self.max_retries < 0:
            raise ValueError("load_bound >= 1, load_slack >= 0, block_size >= 1 and max_retries >= 0 please")
        if not self.load_interval_s > 0:
            raise ValueError("load_interval_s > 0 please")
        for canary in self.canary:
            if any(not 0 <= p <= 100 for p in canary.percent.values()):
                raise ValueError(f"canary {canary.model}: percentages go from 0 to 100")


def routing_from_dict(raw: Mapping[str, Any] | None, where: str) -> RoutingSettings:
    """`routing:` in fleet.yaml: the policy and its bound, health checks, product rules, canaries, shadows."""
    raw = dict(raw or {})
    try:
        health = section(HealthSettings, raw.pop("health", None), f"{where}.health")
        rules = {alias: [RoutingRule(**r) for r in rules] for alias, rules in (raw.pop("rules", None) or {}).items()}
        canary = [Canary(**c) for c in raw.pop("canary", None) or []]
        shadow = [Shadow(**s) for s in raw.pop("shadow", None) or []]
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None
    settings = section(RoutingSettings, raw, where)
    settings.health, settings.rules, settings.canary, settings.shadow = health, rules, canary, shadow
    settings.__post_init__()
    return settings
