"""The router in a disaggregated pool: prefill replicas never stream a response; a request for a decode replica gets
a prefill replica (its own pool's first), unless the decode replica holds most of the prompt already."""

from __future__ import annotations

import pytest

from tokenfleet.router.catalog import ModelCatalog, ModelSpec, PoolSpec
from tokenfleet.router.registry import ReplicaRecord
from tokenfleet.router.router import Router
from tokenfleet.router.settings import RoutingSettings


class NoUpstream:
    async def load(self):
        raise AssertionError("not called")


def router(**routing) -> Router:
    pools = [PoolSpec("near"), PoolSpec("far", latency_ms=50)]
    catalog = ModelCatalog([ModelSpec("m", "/unused", pools=pools)])
    return Router(catalog, RoutingSettings(**routing), 8, lambda url, name, kind: NoUpstream())


def join(r: Router, name: str, pool: str, role: str) -> None:
    r.on_registry_change([ReplicaRecord(name, f"http://{name}", "m", pool=pool, role=role)], [])


def test_prefill_replicas_take_no_streams_and_decode_ones_get_a_prefill_replica_nearby():
    r = router()
    join(r, "p-far", "far", "prefill")
    join(r, "p-near", "near", "prefill")
    join(r, "d-near", "near", "decode")
    pools = r.models["m"]
    prompt = list(range(200))
    for _ in range(5):
        replica, _ = pools.choose(prompt)
        assert replica.name == "d-near"
    assert pools.choose_prefill(prompt, pools.replicas["d-near"]).name == "p-near"
    assert pools.choose_prefill(prompt, pools.replicas["d-near"], exclude=["p-near"]).name == "p-far"
    pools.set_draining("p-near")
    pools.set_draining("p-far")
    assert pools.choose_prefill(prompt, pools.replicas["d-near"]) is None  # the decode replica prefills itself


def test_a_prompt_mostly_cached_on_the_decode_replica_is_not_prefilled_elsewhere():
    r = router(remote_prefill_min_tokens=64, block_size=16)
    join(r, "p", "near", "prefill")
    join(r, "d", "near", "decode")
    join(r, "b", "near", "both")
    pools = r.models["m"]
    decode, both = pools.replicas["d"], pools.replicas["b"]
    assert pools.wants_remote_prefill(decode, 300, matched_blocks=0)
    assert pools.wants_remote_prefill(decode, 300, matched_blocks=14)  # 76 tokens to compute
    assert not pools.wants_remote_prefill(decode, 300, matched_blocks=15)  # 60
    assert not pools.wants_remote_prefill(both, 300, matched_blocks=0)  # a colocated replica prefills itself


def test_a_pool_role_must_be_known_and_ours():
    with pytest.raises(ValueError, match="role must be one of both, prefill, decode"):
        PoolSpec(role="prefil")
    with pytest.raises(ValueError, match="only tokenfleet replicas"):
        PoolSpec(role="decode", kind="openai")


def test_the_registry_record_carries_the_role():
    record = ReplicaRecord("h:1", "http://h:1", "m", role="prefill")
    assert ReplicaRecord.from_json(record.to_json()).role == "prefill"
    assert ReplicaRecord.from_json('{"name": "h", "url": "http://h", "model": "m"}').role == "both"  # older records
