"""The quota in Redis, shared by every gateway of a fleet: each reserve and each reconcile is one Lua script call
(lua.py), all keys of a request under the tenant's hash tag, every key expiring once idle. Hot tenants are split
into slices (slices.py). Concurrent calls share round trips, and the reserves and reconciles of one tick run as one
call of the batch script (lua.BATCH: the same effects and replies as the single calls one after the other; a lone
call goes as its single script; redis_client.py). A scope set's key names, slice plan and limits are packed into its
reserve and reconcile calls once (PreparedScopes) and kept, so a call packs only its request id and token counts."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import redis.asyncio as aioredis

from tokenfleet.quota import lua
from tokenfleet.quota.base import Decision, Remaining, Reservation, Scope
from tokenfleet.quota.checked import CheckedQuota
from tokenfleet.quota.limits import Limits
from tokenfleet.quota.rebalance import Rebalancer
from tokenfleet.quota.redis_client import OpTemplate, RedisStore, Script, bulks, connect, text
from tokenfleet.quota.rules import ScopeState, day_name, day_number, decide
from tokenfleet.quota.slices import SlicePlan

RESERVE, RECONCILE, INSPECT = Script(lua.RESERVE), Script(lua.RECONCILE), Script(lua.INSPECT)
EXTEND, BATCH = Script(lua.EXTEND), Script(lua.BATCH)
CLOSE_WAIT_S = 2.0  # how long close() waits for rebalance tasks to stop
CACHED_SCOPES = 65_536  # scopes whose key names are kept (least recently used beyond that are made again)
log = logging.getLogger("tokenfleet.quota")


@dataclass(frozen=True, slots=True)
class PreparedScopes:
    """One request's scope set in one slice as the scripts take it, made once and kept: the limits this slice
    enforces, and its reserve and reconcile calls packed but for what changes per request."""

    plan: SlicePlan
    limits: tuple[Limits, ...]
    reserve: OpTemplate  # takes request_id, tokens
    reconcile: OpTemplate  # takes the reconciled marker's key, request_id, extra tokens, day number
    marker_prefix: str  # the reconciled marker's key without the request id


class RedisQuota(CheckedQuota):
    """`client`: a redis.asyncio client (use `from_url` for one with the short timeouts and no retries this needs).
    `hot_tenants`: tenant -> number of slices; `slice_index`: which slice this gateway draws from."""

    name = "redis"

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "tokenfleet:quota:",
        *,
        lease_s: float = 900.0,
        marker_ttl_s: int = 3600,
        concurrency_retry_s: float = 1.0,
        call_timeout_s: float = 1.0,
        max_in_flight: int = 16,
        hot_tenants: Mapping[str, int] | None = None,
        slice_index: int = 0,
        rebalance_interval_s: float = 2.0,
        min_share: float = 0.25,
        auto_rebalance: bool = True,
        owns_client: bool = False,
    ) -> None:
        if lease_s <= 0 or marker_ttl_s < 1 or concurrency_retry_s <= 0 or rebalance_interval_s <= 0:
            raise ValueError("lease_s, marker_ttl_s, concurrency_retry_s and rebalance_interval_s must be positive")
        if not 0 < min_share <= 1:
            raise ValueError(f"min_share must be in (0, 1], got {min_share}")
        if slice_index < 0 or any(n < 1 for n in (hot_tenants or {}).values()):
            raise ValueError("slice_index must be >= 0 and slice counts >= 1")
        self.store = RedisStore(client, prefix, call_timeout_s, max_in_flight)
        self.lease_s, self.marker_ttl_s, self.concurrency_retry_s = lease_s, marker_ttl_s, concurrency_retry_s
        self._lease = repr(float(lease_s))
        self.hot_tenants, self.slice_index = dict(hot_tenants or {}), slice_index
        self.rebalance_interval_s, self.min_share = rebalance_interval_s, min_share
        self.auto_rebalance = auto_rebalance  # False: the caller runs rebalancer(tenant).rebalance_once() itself
        self.rebalancers: dict[str, Rebalancer] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._owns_client = owns_client
        self._plans: dict[tuple[str, int | None], SlicePlan] = {}
        self._prepared: dict[tuple[tuple[Scope, ...], int | None], PreparedScopes] = {}
        # request id -> the scopes and prepared calls of its reservation, until reconciled: a reconcile of the
        # Reservation a reserve returned finds its calls without hashing and comparing its scopes again
        self._open: dict[str, tuple[tuple[Scope, ...], PreparedScopes]] = {}
        self._scope_keys = functools.lru_cache(maxsize=CACHED_SCOPES)(self._make_scope_keys)
        self._packed_scope_keys = functools.lru_cache(maxsize=CACHED_SCOPES)(self._make_packed_scope_keys)

    @classmethod
    def from_url(
        cls,
        url: str,
        prefix: str = "tokenfleet:quota:",
        *,
        connect_timeout_s: float = 0.25,
        socket_timeout_s: float = 0.25,
        max_connections: int = 16,
        **options: Any,
    ) -> RedisQuota:
        client = connect(
            url, connect_timeout_s=connect_timeout_s, socket_timeout_s=socket_timeout_s, max_connections=max_connections
        )
        options.setdefault("call_timeout_s", connect_timeout_s + socket_timeout_s + 0.25)
        return cls(client, prefix, max_in_flight=max_connections, owns_client=True, **options)

    def plan(self, tenant: str, index: int | None = None) -> SlicePlan:
        plan = self._plans.get((tenant, index))
        if plan is None:
            if len(self._plans) >= CACHED_SCOPES:
                self._plans.clear()
            plan = self._plans[(tenant, index)] = self._make_plan(tenant, index)
        return plan

    def _make_plan(self, tenant: str, index: int | None) -> SlicePlan:
        count = self.hot_tenants.get(tenant)
        if index is None and count:
            index = self.slice_index % count
        if index is None:
            return SlicePlan(tenant)
        return SlicePlan(tenant, index, count or index + 1, self.min_share)

    def prepared(self, scopes: tuple[Scope, ...], index: int | None = None) -> PreparedScopes:
        """`scopes` in slice `index` (None: this gateway's slice of the tenant) as the scripts take them."""
        found = self._prepared.get((scopes, index))
        if found is None:
            if len(self._prepared) >= CACHED_SCOPES:
                self._prepared.clear()
            found = self._prepared[(scopes, index)] = self._prepare(scopes, self.plan(scopes[0].tenant, index))
        return found

    def _prepare(self, scopes: tuple[Scope, ...], plan: SlicePlan) -> PreparedScopes:
        limits = tuple(plan.limits(s.limits) for s in scopes)
        keys = b"".join([self._packed_scope_keys(plan.tag, s.name) for s in scopes])
        nkeys = 2 * len(scopes)
        if plan.sliced:
            keys += bulks((self.store.key(plan.tag, "share"),))
            nkeys += 1
        n, s0, limit_args = len(scopes), _s0(plan), b"".join([_packed_limits(lim) for lim in limits])
        # RESERVE: request_id and tokens are its first arguments; RECONCILE: the marker is its last key, then
        # request_id, extra and day its first arguments (lua.py); both also run as calls of BATCH
        reserve = OpTemplate.packed(
            RESERVE, BATCH, "r", keys, nkeys, 0, 2, bulks((self._lease, n, s0)) + limit_args, 3 + 4 * n
        )
        reconcile = OpTemplate.packed(
            RECONCILE, BATCH, "c", keys, nkeys, 1, 3, bulks((n, self.marker_ttl_s, s0)) + limit_args, 3 + 4 * n
        )
        return PreparedScopes(plan, limits, reserve, reconcile, self.store.key(plan.tag, "reconciled", ""))

    def scope_keys(self, plan: SlicePlan, scope: Scope) -> tuple[str, str]:
        """The scope's hash and lease zset in the plan's slice."""
        return self._scope_keys(plan.tag, scope.name)

    def _make_scope_keys(self, tag: str, name: str) -> tuple[str, str]:
        return self.store.key(tag, name, "q"), self.store.key(tag, name, "leases")

    def _make_packed_scope_keys(self, tag: str, name: str) -> bytes:
        return bulks(self._scope_keys(tag, name))

    async def _reserve(self, request_id: str, scopes: tuple[Scope, ...], tokens: int) -> Decision:
        prepared = self.prepared(scopes)
        plan = prepared.plan
        if plan.sliced:
            self._start_rebalancer(plan)
        reply = await self.store.run_call(prepared.reserve.call(request_id, tokens))
        allowed, now, day, share = reply[0] == 1, float(reply[1]), int(reply[2]), float(reply[3])
        states = [
            ScopeState(
                scope,
                lim,
                _level(reply[4 + 4 * i]),
                _level(reply[5 + 4 * i]),
                reply[6 + 4 * i],
                reply[7 + 4 * i],
                share,
                plan.max_share,
            )
            for i, (scope, lim) in enumerate(zip(scopes, prepared.limits))
        ]
        reservation = None
        if allowed:
            reservation = Reservation(request_id, scopes, tokens, day_name(day), self.name, plan.index)
            if len(self._open) >= CACHED_SCOPES:  # reservations never reconciled here (e.g. a failover's)
                self._open.clear()
            self._open[request_id] = (scopes, prepared)
        return decide(states, tokens, reservation, now, self.concurrency_retry_s)

    async def _reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        request_id = reservation.request_id
        found = self._open.pop(request_id, None)
        if found is not None and found[0] is reservation.scopes and found[1].plan.index == reservation.slice:
            prepared = found[1]
        else:
            prepared = self.prepared(reservation.scopes, reservation.slice)
        extra, day = used_tokens - reservation.tokens, day_number(reservation.day)
        await self.store.run_call(prepared.reconcile.call(prepared.marker_prefix + request_id, request_id, extra, day))

    async def _extend(self, reservation: Reservation, at_least: int, at_most: int) -> Reservation | None:
        plan = self.plan(reservation.scopes[0].tenant, reservation.slice)
        keys = [self.scope_keys(plan, s)[0] for s in reservation.scopes]
        keys.append(self.store.key(plan.tag, "reconciled", reservation.request_id))
        if plan.sliced:
            keys.append(self.store.key(plan.tag, "share"))
        args = [
            at_least,
            at_most,
            day_number(reservation.day),
            len(reservation.scopes),
            _s0(plan),
            *_limit_args(plan.limits(s.limits) for s in reservation.scopes),
        ]
        grant = int(await self.store.run(EXTEND, keys, args))
        return replace(reservation, tokens=reservation.tokens + grant) if grant else None

    async def remaining(self, scope: Scope) -> Remaining:
        """What `scope` has left now in this gateway's slice (read only)."""
        plan = self.plan(scope.tenant)
        lim = plan.limits(scope.limits)
        keys = list(self.scope_keys(plan, scope))
        if plan.sliced:
            keys.append(self.store.key(plan.tag, "share"))
        reply = text(await self.store.run(INSPECT, keys, [*limit_numbers(lim), _s0(plan)])).split(" ")
        rpm, tpm, live, used = map(_number, reply[1:5])
        conc, tpd = lim.concurrent_requests, lim.tokens_per_day
        return Remaining(
            rpm,
            tpm,
            None if conc is None or live is None else int(conc - live),
            None if tpd is None or used is None else int(tpd - used),
        )

    async def share(self, tenant: str, index: int) -> float:
        """A hot tenant's slice's current share of the per-minute buckets."""
        plan = self.plan(tenant, index)
        value = await self.store.command("HGET", self.store.key(plan.tag, "share"), "s")
        return plan.initial_share if value is None else float(text(value))

    def rebalancer(self, tenant: str) -> Rebalancer:
        if tenant not in self.rebalancers:
            self.rebalancers[tenant] = Rebalancer(
                self.store, tenant, self.hot_tenants[tenant], self.min_share, self.rebalance_interval_s
            )
        return self.rebalancers[tenant]

    def _start_rebalancer(self, plan: SlicePlan) -> None:
        if self.auto_rebalance and plan.tenant not in self._tasks:  # on the tenant's first request; close() stops it
            self._tasks[plan.tenant] = asyncio.get_running_loop().create_task(self.rebalancer(plan.tenant).run())

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        if self._tasks:
            _, stuck = await asyncio.wait(self._tasks.values(), timeout=CLOSE_WAIT_S)
            if stuck:
                log.warning("quota: %d rebalance task(s) did not stop within %.0f s", len(stuck), CLOSE_WAIT_S)
        self._tasks.clear()
        await self.store.close()
        if self._owns_client:
            await self.store.client.aclose()


@functools.lru_cache(maxsize=4096)
def limit_numbers(lim: Limits) -> tuple[int, int, int, int]:
    """One scope's limits as the scripts take them: rpm tpm conc tpd, -1 for unlimited."""
    return tuple(  # type: ignore[return-value]
        -1 if v is None else v
        for v in (lim.requests_per_minute, lim.tokens_per_minute, lim.concurrent_requests, lim.tokens_per_day)
    )


@functools.lru_cache(maxsize=4096)
def _packed_limits(lim: Limits) -> bytes:
    return bulks(limit_numbers(lim))


def _limit_args(limits: Iterable[Limits]) -> list[int]:
    return [number for lim in limits for number in limit_numbers(lim)]


def _number(value: str) -> float | None:
    return None if value == "-" else float(value)


def _level(value: bytes | None) -> float | None:
    """A level as RESERVE replies it: 17 digits, or nil where unlimited."""
    return None if value is None else float(value)


def _s0(plan: SlicePlan) -> str:
    return repr(plan.initial_share) if plan.sliced else "0"
