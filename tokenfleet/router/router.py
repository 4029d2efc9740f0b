"""The fleet as the gateway sees it: every model's pools and replicas (configured, or joining and leaving through
the Redis registry), their load and health kept fresh in the background, canary and shadow traffic."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenfleet.router.catalog import ModelCatalog, ModelSpec, RequestFacts, Resolution
from tokenfleet.router.health import HealthTracker
from tokenfleet.router.load import LoadUnavailable, Upstream
from tokenfleet.router.policies import RoutingPolicy, make_policy
from tokenfleet.router.pool import ModelPools
from tokenfleet.router.settings import RoutingSettings

if TYPE_CHECKING:
    from tokenfleet.router.registry import ReplicaRecord

log = logging.getLogger(__name__)


class Router:
    def __init__(
        self,
        catalog: ModelCatalog,
        settings: RoutingSettings,
        slots_per_replica: int,
        make_upstream: Callable[[str, str, str], Upstream],
    ) -> None:
        self.catalog, self.settings = catalog, settings
        self.health = HealthTracker(settings.health)
        self.make_upstream = make_upstream  # (url, name, kind) -> Upstream
        self.models = {
            name: ModelPools(
                spec,
                self.health,
                self._policy(),
                slots_per_replica,
                block_size=settings.block_size,
                remote_prefill_min_tokens=settings.remote_prefill_min_tokens,
            )
            for name, spec in catalog.models.items()
        }
        for canary in settings.canary:
            if catalog.lookup(canary.model) is None or catalog.lookup(canary.version) is None:
                raise ValueError(f"canary names an unknown model: {canary.model} / {canary.version}")
        for shadow in settings.shadow:
            if catalog.lookup(shadow.model) is None or catalog.lookup(shadow.candidate) is None:
                raise ValueError(f"shadow names an unknown model: {shadow.model} / {shadow.candidate}")

    def _policy(self) -> RoutingPolicy:
        s = self.settings
        return make_policy(s.policy, s.block_size, s.load_bound, s.load_slack)

    def add_configured_replicas(self) -> None:
        for pools in self.models.values():
            for pool in pools.spec.pools:
                for url in pool.replicas:
                    pools.add(url, url, pool.name, pool.kind, self._upstream_maker(pool.kind), pool.role)

    def _upstream_maker(self, kind: str) -> Callable[[str, str], Upstream]:
        """make_upstream with the replica kind bound: (url, name) -> Upstream."""
        return lambda url, name: self.make_upstream(url, name, kind)

    # --- choosing the model -----------------------------------------------------------------------------------

    def resolve(self, requested: str, facts: RequestFacts, tier: str, request_id: str) -> Resolution:
        """The model a request runs on: its name or alias, product rules for routing aliases, then a canary."""
        resolution = self.catalog.resolve(requested, facts)
        for canary in self.settings.canary:  # a request that pins a version is never moved
            if requested == canary.model and _draw(request_id, "canary") < canary.share(tier):
                version = self._configured(canary.version)
                return Resolution(version, requested, f"canary:{canary.version}", version.deprecated_on)
        return resolution

    def shadow_for(self, model_name: str, request_id: str) -> str | None:
        for shadow in self.settings.shadow:
            if (
                self._configured(shadow.model).name == model_name
                and _draw(request_id, "shadow") < shadow.percent / 100.0
            ):
                return self._configured(shadow.candidate).name
        return None

    def _configured(self, name: str) -> ModelSpec:
        """A model a canary or shadow names (checked in __init__)."""
        spec = self.catalog.lookup(name)
        if spec is None:
            raise ValueError(f"canary or shadow names an unknown model: {name}")
        return spec

    def pools_for(self, model_name: str) -> ModelPools:
        """The model's pools; when none of its replicas can take work, its fallback model's."""
        pools = self.models[model_name]
        fallback = pools.spec.fallback
        if fallback and not any(self._trusted(r) for r in pools.replicas):
            log.warning("model %s has no healthy replica: using its fallback %s", model_name, fallback)
            return self.models[fallback]
        return pools

    def _trusted(self, replica: str) -> bool:
        """Available and not failing right now. (The health tracker never ejects a whole pool, so that a pool keeps
        serving through a blip; for choosing the fallback model, a replica failing in a row counts as down too.)"""
        state = self.health.replicas.get(replica)
        return (
            self.health.available(replica)
            and state is not None
            and state.consecutive_failures < self.settings.health.consecutive_failures
        )

    # --- keeping the picture fresh -----------------------------------------------------------------------------

    async def refresh_loads(self) -> None:
        """Every interval: each replica's load report (ours: /load; external: vLLM's /metrics)."""
        while True:
            replicas = [(pools, r) for pools in self.models.values() for r in list(pools.replicas.values())]
            marks = [r.state.mark() for _, r in replicas]  # what each report may count as this router's own
            reports = await asyncio.gather(*(r.upstream.load() for _, r in replicas), return_exceptions=True)
            for (pools, replica), mark, report in zip(replicas, marks, reports):
                if isinstance(report, LoadUnavailable):
                    if report.reason in ("connect", "timeout", "5xx"):
                        self.health.record_failure(replica.name, report.reason, "load report")
                elif isinstance(report, BaseException):
                    log.warning("load report of %s failed: %r", replica.name, report)
                else:
                    pools.update_load(replica.name, report, mark)
            await asyncio.sleep(self.settings.load_interval_s)

    def on_registry_change(self, joined: list[ReplicaRecord], left: list[ReplicaRecord]) -> None:
        """Replicas registered in Redis join their model's pools; expired or withdrawn ones leave. A record that
        changed in place (it started draining) comes as left + joined and is updated, not re-added."""
        changed = {record.name for record in joined}
        for record in left:
            pools = self._pools_of(record.model)
            if pools is not None and record.name not in changed:
                pools.remove(record.name)
        for record in joined:
            pools = self._pools_of(record.model)
            if pools is None:
                log.warning("replica %s serves %s, which this fleet does not know; ignored", record.url, record.model)
                continue
            pools.add(record.name, record.url, record.pool, record.kind, self._upstream_maker(record.kind), record.role)
            pools.set_draining(record.name, record.draining)

    def _pools_of(self, model: str) -> ModelPools | None:
        spec = self.catalog.lookup(model)
        return self.models.get(spec.name) if spec is not None else None

    def queued_tokens(self) -> int:
        return sum(r.state.queued_tokens for pools in self.models.values() for r in pools.replicas.values())

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        return {name: pools.snapshot() for name, pools in self.models.items()}


def _draw(request_id: str, purpose: str) -> float:
    """A number in [0, 1) fixed by the request id: the same request always lands on the same side of a split."""
    digest = hashlib.blake2b(f"{purpose}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64
