"""Choosing among a model's pools and replicas: the nearest pool with room, the next one when it is full or
unhealthy, draining replicas skipped, the fallback model when none is left, and registry changes applied."""

from __future__ import annotations

import pytest

from tokenfleet.router.catalog import ModelCatalog, ModelSpec, PoolSpec
from tokenfleet.router.policies import NoReplicaAvailable
from tokenfleet.router.registry import ReplicaRecord
from tokenfleet.router.router import Router
from tokenfleet.router.settings import RoutingSettings


def router(fallback: bool = False) -> Router:
    big = ModelSpec(
        "big",
        "/x",
        pools=[
            PoolSpec("near", ["http://near-1", "http://near-2"], latency_ms=5),
            PoolSpec("far", ["http://far-1"], latency_ms=80),
        ],
        fallback="small" if fallback else None,
    )
    small = ModelSpec("small", "/x", pools=[PoolSpec("near", ["http://small-1"])])
    r = Router(
        ModelCatalog([big, small]), RoutingSettings(), slots_per_replica=2, make_upstream=lambda url, name, kind: url
    )
    r.add_configured_replicas()
    return r


def test_the_nearest_pool_with_room_wins_then_the_next():
    pools = router().models["big"]
    chosen = [pools.choose(list(range(40 + i)))[0] for i in range(4)]
    assert all(r.pool == "near" for r in chosen[:1])
    for replica in pools.replicas.values():
        if replica.pool == "near":
            replica.state.in_flight = 2  # both near replicas full (2 slots each)
    replica, _ = pools.choose(list(range(50)))
    assert replica.pool == "far", "a full pool sends work to the next nearest one"
    pools.replicas["http://far-1"].state.in_flight = 5
    replica, _ = pools.choose(list(range(50)))
    assert replica.pool == "near", "when every pool is full, the one with the most room left"


def test_unhealthy_and_draining_replicas_are_skipped():
    r = router()
    pools = r.models["big"]
    for _ in range(3):
        r.health.record_failure("http://near-1", "connect")
    pools.set_draining("http://near-2")
    assert {pools.choose(list(range(30 + i)))[0].name for i in range(5)} == {"http://far-1"}
    pools.set_draining("http://far-1")
    pools.set_draining("http://near-1")
    assert not pools.can_serve()
    with pytest.raises(NoReplicaAvailable):
        pools.choose([1, 2, 3])


def test_with_no_healthy_replica_left_the_ejected_ones_are_tried():
    """Envoy's panic mode: a request whose other replicas just failed goes to an ejected one rather than failing
    for sure (a replica ejected while it was starting up sat healthy and idle while every stream failed)."""
    r = router()
    pools = r.models["big"]
    for _ in range(3):
        r.health.record_failure("http://near-1", "connect")
    assert r.health.state("http://near-1") == "open"
    assert pools.can_serve()
    replica, choice = pools.choose([1, 2, 3], exclude=["http://near-2", "http://far-1"])
    assert replica.name == "http://near-1" and choice.reason.startswith("panic:")
    replica, choice = pools.choose([1, 2, 3])
    assert replica.name != "http://near-1" and not choice.reason.startswith("panic"), "healthy ones come first"


def test_a_model_with_no_healthy_replica_falls_back_to_its_fallback_model():
    r = router(fallback=True)
    assert r.pools_for("big").spec.name == "big"
    for name in ("http://near-1", "http://near-2", "http://far-1"):
        for _ in range(3):
            r.health.record_failure(name, "5xx")
    assert r.pools_for("big").spec.name == "small"


def test_registry_changes_join_leave_and_drain_in_place():
    r = router()
    record = ReplicaRecord("h:1", "http://h:1", "big", pool="near")
    r.on_registry_change([record], [])
    assert "h:1" in r.models["big"].replicas
    draining = ReplicaRecord("h:1", "http://h:1", "big", pool="near", draining=True)
    r.on_registry_change([draining], [record])
    assert r.models["big"].replicas["h:1"].draining, "a flag change updates the replica, it is not re-added"
    r.on_registry_change([], [draining])
    assert "h:1" not in r.models["big"].replicas
    r.on_registry_change([ReplicaRecord("h:2", "http://h:2", "unknown-model")], [])
    assert all("h:2" not in p.replicas for p in r.models.values()), "a replica of an unknown model is ignored"


def test_canary_and_shadow_draws_are_fixed_by_the_request_id():
    from tokenfleet.router.settings import Canary, Shadow

    settings = RoutingSettings(canary=[Canary("big", "small", {"free": 50})], shadow=[Shadow("big", "small", 30)])
    big = ModelSpec("big", "/x", aliases=["b"])
    r = Router(ModelCatalog([big, ModelSpec("small", "/x")]), settings, 2, lambda url, name, kind: url)
    from tokenfleet.router.catalog import RequestFacts

    moved = [r.resolve("big", RequestFacts(5), "free", f"req-{i}").model.name for i in range(2000)]
    assert abs(moved.count("small") / 2000 - 0.5) < 0.05
    assert {r.resolve("big", RequestFacts(5), "paid", f"req-{i}").model.name for i in range(200)} == {"big"}
    again = [r.resolve("big", RequestFacts(5), "free", f"req-{i}").model.name for i in range(2000)]
    assert again == moved, "the same request always lands on the same side"
    shadowed = sum(r.shadow_for("big", f"req-{i}") == "small" for i in range(2000))
    assert abs(shadowed / 2000 - 0.3) < 0.05
