"""The autoscaler inside a gateway built by the real wiring: its signals read from the router and the fair queues,
its decisions carried out on the router (drain, undrain, remove) and by an orchestrator (start, stop), the batch
gate, and the metrics on the gateway's /metrics."""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.dispatch.sim import Grant
from tests.gateway.inprocess import multi_model_gateway
from tokenfleet.autoscale import AutoscaleSettings, PoolPolicy
from tokenfleet.autoscale.service import add_autoscaler
from tokenfleet.autoscale.signals import ReplicaSignals, pool_signals
from tokenfleet.commands.serve import build_gateway
from tokenfleet.config import DispatchSettings, FleetConfig
from tokenfleet.dispatch.overload import OverloadLadder
from tokenfleet.dispatch.tickets import Ticket
from tokenfleet.gateway.gateway import ModelInfo
from tokenfleet.gateway.resume import MemoryResumeBuffer
from tokenfleet.model.tokenizer import Tokenizer
from tokenfleet.router.catalog import ModelSpec, PoolSpec

pytestmark = pytest.mark.anyio


class Stub:
    """A replica the router knows by name; nothing is ever sent to it here."""

    kind = "tokenfleet"

    def __init__(self, name: str) -> None:
        self.name = name


class FakeOrchestrator:
    def __init__(self, owned: dict[str, float]) -> None:
        self._owned, self.started, self.stopped, self.launching, self.halting = owned, [], [], {}, {}

    def starting(self) -> dict[str, int]:
        return dict(self.launching)

    def owned(self) -> dict[str, float]:
        return dict(self._owned)

    def stopping(self) -> dict[str, int]:
        return dict(self.halting)

    async def poll(self) -> None:
        pass

    async def start(self, model: str, region: str, count: int) -> None:
        self.started.append((model, region, count))
        key = f"{model}/{region}"
        self.launching[key] = self.launching.get(key, 0) + count

    async def stop(self, name: str) -> None:
        self.stopped.append(name)


def fleet(demo_model_dir, **autoscale):
    pools = {
        "chat": PoolPolicy(min_replicas=1, max_replicas=3, target_in_flight=4),
        "code": PoolPolicy(min_replicas=1, max_replicas=2, target_in_flight=4),
    }
    settings = AutoscaleSettings(
        **{
            "enabled": True,
            "mode": "reactive",
            "scale_down_delay_s": 0,
            "cooldown_s": 0,
            "drain_settle_s": 0,
            "pools": pools,
            **autoscale,
        }
    )
    dispatch = DispatchSettings(slots_per_replica=4, prefill_tokens_per_s=1000)
    gateway = multi_model_gateway(
        demo_model_dir, {"chat": [Stub("a"), Stub("b")], "code": [Stub("c")]}, dispatch=dispatch
    )
    config = FleetConfig(
        models=[ModelSpec("chat", str(demo_model_dir)), ModelSpec("code", str(demo_model_dir))],
        dispatch=dispatch,
        autoscale=settings,
    )
    return gateway, config


def set_load(gateway, model: str, name: str, running=0, waiting=0, queued_tokens=0, kv=0.0) -> None:
    state = gateway.router.models[model].replicas[name].state
    state.running, state.waiting, state.queued_tokens, state.kv_usage = running, waiting, queued_tokens, kv


async def test_signals_come_from_the_router_and_the_fair_queue(demo_model_dir):
    gateway, config = fleet(demo_model_dir)
    service = add_autoscaler(gateway, config)
    chat = gateway.admission.dispatchers["chat"]
    chat.set_slots(3)
    held = [await chat.acquire(Ticket(f"p{i}", "acme", "paid", 100)) for i in range(2)]
    held.append(await chat.acquire(Ticket("b0", "lab", "batch", 100)))
    waiters = [asyncio.ensure_future(chat.acquire(Ticket(f"q{i}", "acme", "paid", 500))) for i in range(2)]
    waiters.append(asyncio.ensure_future(chat.acquire(Ticket("bq", "lab", "batch", 50))))
    await asyncio.sleep(0)
    set_load(gateway, "chat", "a", running=3, waiting=1, queued_tokens=1000, kv=0.5)
    set_load(gateway, "chat", "b", running=1, kv=0.3)
    gateway.router.models["chat"].set_draining("b")

    signals = service.reader.read(service.reader.shares(100.0), {"chat/default": 1}, {"a": 1.0})["chat/default"]
    assert (signals.ready, signals.starting, signals.draining) == (1, 1, 1)
    assert signals.queued_requests == 2 and signals.batch_queued == 1 and signals.batch_in_flight == 1
    assert signals.queued_tokens == 1000 + 1000 and signals.in_flight == 4 + 1
    assert signals.kv_usage_mean == signals.kv_usage_max == 0.5, "ready replicas only"
    assert math.isclose(signals.projected_ttft_s, 2000 / 1000), "queued prefill at one ready replica's rate"
    assert [(r.name, r.removable) for r in signals.replicas] == [("a", True), ("b", False)]
    waiters += [
        asyncio.ensure_future(chat.acquire(Ticket(f"r{i}", "acme", tier, 5)))
        for i, tier in enumerate(("paid", "paid", "batch"))
    ]
    await asyncio.sleep(0)
    assert math.isclose(service.reader.shares(110.0)["chat/default"].arrival_rate, 2 / 10), "batch arrivals left out"
    for waiter in waiters:
        waiter.cancel()
    for slot in held:
        chat.release(slot)


async def test_the_service_drains_removes_and_starts_through_the_router_and_the_orchestrator(demo_model_dir):
    gateway, config = fleet(demo_model_dir)
    service = add_autoscaler(gateway, config)
    orchestrator = service.orchestrator = FakeOrchestrator({"a": 1.0, "b": 2.0, "c": 3.0})
    set_load(gateway, "chat", "a", running=2)
    decisions = await service.step()  # chat: 2 ready, 2 in flight (need 1): drain the newest idle one
    assert decisions["chat/default"].desired == 1 and decisions["chat/default"].drain == ["b"]
    assert gateway.router.models["chat"].replicas["b"].draining
    pace = gateway.admission.batch_pace
    assert pace.keys() == {"chat", "code"} and all(rate > 0 for rate in pace.values()), "idle capacity: batch uses it"
    assert pace["chat"] == pytest.approx(decisions["chat/default"].spare_replicas * 1000), "at their prefill rate"
    decisions = await service.step()
    assert decisions["chat/default"].remove == ["b"] and "b" not in gateway.router.models["chat"].replicas
    assert orchestrator.stopped == ["b"]
    set_load(gateway, "code", "c", running=4, waiting=4)  # code: 8 in flight, 4 a replica
    decisions = await service.step()
    assert decisions["code/default"].desired == 2 and orchestrator.started == [("code", "default", 1)]
    decisions = await service.step()
    assert decisions["code/default"].start == 0, "the one starting counts"
    assert gateway.admission.batch_pace["chat"] > 0 and gateway.admission.batch_pace["code"] == 0, (
        "code has no room to spare"
    )
    text = gateway.render_metrics().decode()
    for line in (
        'tokenfleet_autoscale_desired_replicas{model="code",pool="default"} 2.0',
        'tokenfleet_autoscale_ready_replicas{model="chat",pool="default"} 1.0',
        'tokenfleet_autoscale_starting_replicas{model="code",pool="default"} 1.0',
        'tokenfleet_autoscale_in_flight_requests{model="code",pool="default"} 8.0',
        'tokenfleet_autoscale_batch_allowed{model="code",pool="default"} 0.0',
        'tokenfleet_autoscale_batch_tokens_per_second{model="code",pool="default"} 0.0',
        'tokenfleet_autoscale_scale_events_total{direction="up",model="code",pool="default"} 1.0',
    ):
        assert line in text, line


async def test_a_stopping_replica_holds_its_machine_under_a_budget(demo_model_dir):
    """Removed from the router and sent SIGTERM, a replica still holds its GPU until its process exits: under a
    shared budget nothing starts in its place until then."""
    gateway, config = fleet(demo_model_dir, budget=4)
    service = add_autoscaler(gateway, config)
    orchestrator = service.orchestrator = FakeOrchestrator({"a": 1.0, "b": 2.0, "c": 3.0})
    orchestrator.halting = {"chat/default": 1}  # 2 + 1 in the router, 1 stopping: the budget of 4 is used up
    for name in ("a", "b"):
        set_load(gateway, "chat", name, running=6)  # 12 in flight at 4 a replica: chat wants 3
    decisions = await service.step()
    assert service.signals["chat/default"].occupied == 3 and decisions["chat/default"].desired == 3
    assert decisions["chat/default"].start == 0 and orchestrator.started == []
    orchestrator.halting = {}  # its process exited
    decisions = await service.step()
    assert orchestrator.started == [("chat", "default", 1)]


async def test_without_an_orchestrator_it_only_decides_and_exports(demo_model_dir):
    gateway, config = fleet(demo_model_dir)
    service = add_autoscaler(gateway, config)
    assert service.orchestrator is None and service.run in gateway.services
    decisions = await service.step()
    chat = decisions["chat/default"]
    assert chat.desired == 1 and chat.drain == [], "KEDA / the HPA choose the pods"
    assert not any(r.draining for r in gateway.router.models["chat"].replicas.values())
    assert 'tokenfleet_autoscale_desired_replicas{model="chat",pool="default"} 1.0' in gateway.render_metrics().decode()


async def test_the_batch_gate_pauses_or_paces_the_batch_tier_at_ladder_updates(demo_model_dir):
    gateway, _ = fleet(demo_model_dir)
    dispatcher, ladder = gateway.admission.dispatchers["chat"], OverloadLadder()
    ladder.apply(dispatcher, 0.0)
    assert dispatcher.snapshot().tiers["batch"].paused
    ladder.apply(dispatcher, 1000.0)
    assert not dispatcher.snapshot().tiers["batch"].paused
    dispatcher.submit(Ticket("b1", "org", "batch", 400), Grant())  # the ladder's 1 s target: 500 tokens a 0.5 s
    dispatcher.submit(Ticket("b2", "org", "batch", 400), Grant())
    dispatcher.submit(Ticket("b3", "org", "batch", 400), Grant())
    batch = dispatcher.snapshot().tiers["batch"]
    assert batch.in_use == 2 and batch.queued == 1 and batch.at_limit


def test_autoscaling_a_model_the_fleet_does_not_serve_is_an_error(demo_model_dir):
    gateway, config = fleet(demo_model_dir, pools={"chat": {}, "vision": {}})
    with pytest.raises(ValueError, match="autoscale.pools names model.*vision"):
        add_autoscaler(gateway, config)
    gateway, config = fleet(demo_model_dir, budget=1, pools={"chat": {"min_replicas": 1}})  # code: the defaults
    with pytest.raises(ValueError, match=r"budget 1 is below the pools' min_replicas together \(2\)"):
        add_autoscaler(gateway, config)


def test_a_models_forecast_curve_is_not_bought_again_by_each_region(demo_model_dir):
    """A curve in requests/s for a model with two regions would make each region's pool scale for all of it."""
    regions = [PoolSpec("near", latency_ms=1), PoolSpec("far", latency_ms=20)]
    forecast = {"replica_rps": 4, "forecast": {"curve": [[0, 40]]}}
    for pools, error in (
        ({"chat": forecast}, "chat/near, chat/far"),
        ({"chat": forecast, "chat/far": forecast}, "chat/near"),
        ({"chat": {"replica_rps": 4, "forecast": {"learn": True}}}, None),
        ({"chat/far": forecast, "chat/near": forecast}, None),
    ):
        config = FleetConfig(
            models=[ModelSpec("chat", str(demo_model_dir), pools=regions)],
            autoscale=AutoscaleSettings(enabled=True, pools=pools),
        )
        info = ModelInfo("chat", Tokenizer.from_dir(demo_model_dir), 512)
        gateway, _ = build_gateway(config, {"chat": info}, lambda url, name, kind: None, "local", MemoryResumeBuffer())
        if error is None:
            assert add_autoscaler(gateway, config) is not None
        else:
            with pytest.raises(ValueError, match=f"curve would apply in full to each of the regions {error};"):
                add_autoscaler(gateway, config)


def test_disabled_autoscaling_adds_nothing(demo_model_dir):
    gateway, config = fleet(demo_model_dir, enabled=False)
    services = list(gateway.services)
    assert add_autoscaler(gateway, config) is None and gateway.services == services
    assert b"tokenfleet_autoscale" not in gateway.render_metrics()


async def test_each_region_of_a_model_is_a_pool_of_its_own(demo_model_dir):
    regions = [PoolSpec("near", latency_ms=1), PoolSpec("far", latency_ms=20)]
    spec = ModelSpec("chat", str(demo_model_dir), pools=regions)
    settings = AutoscaleSettings(
        enabled=True, mode="reactive", pools={"chat": {"max_replicas": 3}, "chat/far": {"min_replicas": 2}}
    )
    config = FleetConfig(models=[spec], autoscale=settings)
    info = ModelInfo("chat", Tokenizer.from_dir(demo_model_dir), 512)
    gateway, _ = build_gateway(config, {"chat": info}, lambda url, name, kind: None, "local", MemoryResumeBuffer())
    pools = gateway.router.models["chat"]
    for name, region in (("n1", "near"), ("f1", "far")):
        pools.add(name, "", region, "tokenfleet", lambda url, name: None)
    service = add_autoscaler(gateway, config)
    dispatcher = gateway.admission.dispatchers["chat"]
    dispatcher.set_slots(0)
    waiter = asyncio.ensure_future(dispatcher.acquire(Ticket("q", "acme", "paid", 10)))
    await asyncio.sleep(0)
    decisions = await service.step()
    near, far = service.signals["chat/near"], service.signals["chat/far"]
    assert (near.model, near.region, far.region) == ("chat", "near", "far")
    assert (near.ready, far.ready) == (1, 1)
    assert (near.queued_requests, far.queued_requests) == (1, 0), "the queue feeds the nearest region"
    assert decisions["chat/far"].desired == 2 and decisions["chat/near"].desired == 1
    assert 'tokenfleet_autoscale_desired_replicas{model="chat",pool="far"} 2.0' in gateway.render_metrics().decode()
    waiter.cancel()


def test_a_request_moving_between_replicas_is_counted_once():
    """One request at a time alternating between two replicas: the one it left still reports it (its load report
    is a moment old) while the one it went to counts it fresh. Per replica that is two; for the pool, one."""
    replicas = [ReplicaSignals("a", running=1, in_flight=0), ReplicaSignals("b", running=0, in_flight=1)]
    signals = pool_signals("m/default", replicas, None, 1000.0)
    assert signals.in_flight == 1 and [r.busy for r in replicas] == [1, 1]
