"""Several gateways add up their shares of the autoscaler's signals in the fleet's Redis (real Redis): every one
decides on the fleet's totals, a gateway that stops writing drops out, and without Redis each goes on alone."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from tests.servers import delete_redis_keys, free_port
from tokenfleet.autoscale import AutoscaleSettings, PoolPolicy
from tokenfleet.autoscale.policy import Autoscaler
from tokenfleet.autoscale.shared import SharedShares
from tokenfleet.autoscale.signals import GatewayShare, ReplicaSignals, pool_signals

pytestmark = pytest.mark.anyio
REDIS_URL = "redis://127.0.0.1:6379"


@pytest.fixture
async def prefix():
    prefix = f"tokenfleet-test:{uuid.uuid4().hex}:"
    yield prefix
    delete_redis_keys(prefix)


async def test_every_gateway_sees_the_sum_of_the_live_gateways_shares(prefix):
    client = aioredis.from_url(REDIS_URL)
    a, b, c = (SharedShares(client, prefix, ttl_s=30, me=name) for name in "abc")
    mine_a = {"m/eu": GatewayShare(queued=2, queued_tokens=200, batch_in_use=5, in_use=9, slots=16, arrival_rate=1.5)}
    mine_b = {
        "m/eu": GatewayShare(queued=1, queued_tokens=50, batch_in_use=3, in_use=4, slots=16, arrival_rate=2.0),
        "m/us": GatewayShare(arrival_rate=4.0),
    }
    assert await a.total(mine_a) == mine_a, "alone so far"
    await b.total(mine_b)
    total = await a.total(mine_a)
    assert total["m/eu"] == GatewayShare(
        queued=3, queued_tokens=250, batch_in_use=8, in_use=13, slots=32, arrival_rate=3.5
    )
    assert total["m/us"] == GatewayShare(arrival_rate=4.0), "a pool only another gateway feeds"
    assert (await c.total({}))["m/eu"].arrival_rate == 3.5, "a gateway with no queue of its own sees the others"
    assert await a.total(mine_a) == total, "writing again replaces, never adds twice"
    await client.aclose()


async def test_a_gateway_that_stops_writing_drops_out_after_its_ttl(prefix):
    client = aioredis.from_url(REDIS_URL)
    a, b = SharedShares(client, prefix, ttl_s=5, me="a"), SharedShares(client, prefix, ttl_s=0.3, me="b")
    await b.total({"m/eu": GatewayShare(arrival_rate=7.0)})
    assert (await a.total({}))["m/eu"].arrival_rate == 7.0
    await asyncio.sleep(0.5)
    assert await a.total({}) == {}, "b's shares expired"
    assert await client.hkeys(f"{prefix}{{gateways}}:shares") == [b"a"], "and were deleted"
    assert 0 < await client.pttl(f"{prefix}{{gateways}}:live") <= 10_000, "the keys expire once every gateway is gone"
    await client.aclose()


async def test_without_redis_a_gateway_decides_on_its_own_shares():
    client = aioredis.from_url(f"redis://127.0.0.1:{free_port()}", socket_connect_timeout=0.5)
    mine = {"m/eu": GatewayShare(queued=1, arrival_rate=1.0)}
    assert await SharedShares(client, "tokenfleet-test:none:", ttl_s=5).total(mine) == mine
    await client.aclose()


async def test_other_gateways_batch_work_is_not_interactive_demand(prefix):
    """Three gateways; the replicas run 20 interactive and 180 batch requests, the batch spread over the gateways.
    Each gateway alone would take 200 - its own 60 batch = 140 requests as interactive demand; added up, 20."""
    client = aioredis.from_url(REDIS_URL)
    gateways = [SharedShares(client, prefix, ttl_s=30, me=f"g{i}") for i in range(3)]
    for g in gateways:
        await g.total({"m/eu": GatewayShare(batch_in_use=60, in_use=60 + 7, slots=256)})
    replicas = [ReplicaSignals(f"r{i}", running=50) for i in range(4)]
    policy = Autoscaler(
        AutoscaleSettings(mode="reactive", pools={"m/eu": PoolPolicy(max_replicas=16, target_in_flight=32)})
    )
    alone = pool_signals("m/eu", replicas, GatewayShare(batch_in_use=60, in_use=67, slots=256), 1000.0)
    total = pool_signals(
        "m/eu",
        replicas,
        (await gateways[0].total({"m/eu": GatewayShare(batch_in_use=60, in_use=67, slots=256)}))["m/eu"],
        1000.0,
    )
    assert (alone.interactive_demand, total.interactive_demand) == (140, 20)
    assert policy.need(0.0, total).replicas < 1 < policy.need(0.0, alone).replicas
    await client.aclose()


async def test_a_fleet_gateways_autoscaler_decides_on_the_totals(demo_model_dir, prefix):
    """The real wiring (add_autoscaler with the fleet's redis_url): another gateway's arrivals and queue count."""
    from tests.autoscale.test_service import fleet
    from tokenfleet.autoscale.service import add_autoscaler

    gateway, config = fleet(demo_model_dir)
    config.redis_url, config.routing.register_prefix = REDIS_URL, prefix
    service = add_autoscaler(gateway, config)
    client = aioredis.from_url(REDIS_URL)
    await SharedShares(client, prefix, ttl_s=30, me="other").total(
        {"chat/default": GatewayShare(queued=8, queued_tokens=800, arrival_rate=3.0)}
    )
    await service.step()
    chat = service.signals["chat/default"]
    assert (chat.queued_requests, chat.arrival_rate) == (8, 3.0)
    assert service.decisions["chat/default"].desired == 2, "8 queued at 4 in flight a replica"
    await client.aclose()
