"""The autoscaler as a gateway service: every interval read the pools' signals, decide, publish the decision (the
gateway's /metrics, the batch-tier gate) and, with an orchestrator, act on it: undrain, drain, remove, start."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from tokenfleet.autoscale.local import LocalOrchestrator
from tokenfleet.autoscale.metrics import AutoscaleCollector
from tokenfleet.autoscale.policy import Autoscaler, Decision, batch_gate
from tokenfleet.autoscale.shared import SharedShares
from tokenfleet.autoscale.signals import GatewaySignals, PoolSignals, pool_key

log = logging.getLogger(__name__)


class Orchestrator(Protocol):
    def starting(self) -> dict[str, int]: ...

    def owned(self) -> dict[str, float]: ...

    def stopping(self) -> dict[str, int]: ...

    async def poll(self) -> None: ...

    async def start(self, model: str, region: str, count: int) -> None: ...

    async def stop(self, name: str) -> None: ...


class AutoscaleService:
    def __init__(
        self,
        policy: Autoscaler,
        reader: GatewaySignals,
        orchestrator: Orchestrator | None = None,
        clock: Callable[[], float] = time.time,
        shared: SharedShares | None = None,
    ) -> None:
        """The wall clock by default: forecasts are by time of day. `shared`: with several gateways (a fleet's
        Redis), decide on every gateway's queues and arrivals added up, not this one's alone."""
        self.policy, self.reader, self.orchestrator, self.clock = policy, reader, orchestrator, clock
        self.shared = shared
        self.router, self.admission = reader.router, reader.admission
        self.signals: dict[str, PoolSignals] = {}
        self.decisions: dict[str, Decision] = {}
        self.events: Counter = Counter()  # (pool key, up|down)

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:  # one bad reading must not stop autoscaling for good
                log.exception("autoscaler step failed")
            await asyncio.sleep(self.policy.settings.interval_s)

    async def step(self) -> dict[str, Decision]:
        orchestrator = self.orchestrator
        if orchestrator is not None:
            await orchestrator.poll()
        now = self.clock()
        shares = self.reader.shares(now)
        if self.shared is not None:
            shares = await self.shared.total(shares)
        signals = self.reader.read(
            shares, *((orchestrator.starting(), orchestrator.owned(), orchestrator.stopping()) if orchestrator else ())
        )
        decisions = self.policy.decide(now, signals)
        self._record(decisions)
        self.signals, self.decisions = signals, decisions
        if self.policy.settings.batch_gate:
            self.admission.batch_pace = batch_gate(signals, decisions)
        if orchestrator is not None:
            for key, decision in decisions.items():
                await self._apply(signals[key], decision)
        return decisions

    def _record(self, decisions: dict[str, Decision]) -> None:
        for name, d in decisions.items():
            before = self.decisions.get(name)
            if before is not None and d.desired != before.desired:
                self.events[(name, "up" if d.desired > before.desired else "down")] += 1
            if before is None or d.desired != before.desired or d.start or d.drain or d.undrain or d.remove:
                log.info(
                    "autoscale %s: desired %d (start %d, drain %s, undrain %s, remove %s): %s",
                    name,
                    d.desired,
                    d.start,
                    d.drain,
                    d.undrain,
                    d.remove,
                    d.reason,
                )

    async def _apply(self, s: PoolSignals, d: Decision) -> None:
        pools = self.router.models[s.model]
        for name in d.undrain:
            pools.set_draining(name, False)
        for name in d.drain:
            pools.set_draining(name, True)
        for name in d.remove:
            pools.remove(name)
            await self.orchestrator.stop(name)
        if d.start:
            await self.orchestrator.start(s.model, s.region, d.start)


def _check_curves(settings, router) -> None:
    """A forecast curve (requests/s) given for a model would be read in full by each of its regions' pools, each
    buying the whole forecast's replicas: with several regions, each needs its own (`model/region`)."""
    for name, pools in router.models.items():
        policy, regions = settings.pools.get(name), [pool_key(name, p.name) for p in pools.spec.pools]
        if policy is None or policy.forecast is None or not policy.forecast.curve or len(regions) < 2:
            continue
        shared = [key for key in regions if key not in settings.pools]
        if shared:
            raise ValueError(
                f"autoscale.pools.{name}: its forecast curve would apply in full to each of the regions "
                f"{', '.join(shared)}; give each region its own forecast under {name}/<region>"
            )


def add_autoscaler(gateway, config) -> AutoscaleService | None:
    """With `autoscale.enabled` in the fleet file: the service runs beside the gateway's other loops and its metrics
    join the gateway's /metrics; `orchestrator: local` starts and stops replica processes on this machine."""
    settings = config.autoscale
    if not settings.enabled:
        return None
    router = gateway.router
    unknown = sorted(
        key for key in settings.pools if key not in router.models and key.rsplit("/", 1)[0] not in router.models
    )
    if unknown:
        raise ValueError(f"autoscale.pools names model(s) this fleet does not serve: {', '.join(unknown)}")
    settings.check_budget(
        {pool_key(name, p.name): name for name, pools in router.models.items() for p in pools.spec.pools}
    )
    _check_curves(settings, router)
    reader = GatewaySignals(
        router,
        gateway.admission,
        config.overload.batch_tiers,
        config.dispatch.prefill_tokens_per_s,
        settings.rate_window_s,
    )
    orchestrator = None
    if settings.orchestrator == "local":
        orchestrator = LocalOrchestrator(router, settings, config.redis_url, config.routing.register_prefix)
        gateway.closers.append(orchestrator.close)
    shared = None
    if config.redis_url:
        import redis.asyncio as redis

        shared = SharedShares(redis.from_url(config.redis_url), config.routing.register_prefix, 3 * settings.interval_s)
    service = AutoscaleService(Autoscaler(settings), reader, orchestrator, shared=shared)
    gateway.metrics.registry.register(AutoscaleCollector(service))
    gateway.services.append(service.run)
    log.info(
        "autoscaling %s (%s mode, orchestrator %s)", ", ".join(router.models), settings.mode, settings.orchestrator
    )
    return service
