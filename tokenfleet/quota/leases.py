"""Local leases: a gateway process decides most reserves and reconciles in memory, from budget of each scope it took
from Redis ahead, so a decision costs no round trip and Redis sees a call per lease instead of two per request.

A lease is a real charge in Redis (lua.LEASE): some requests and tokens of one scope's buckets and daily budget, and
some of its concurrency slots (zset members). Limits therefore hold across every gateway, as without leases. What a
lease holds but has not granted is unavailable to other gateways until it comes back, so leases are small and only
taken far from the limits:
- a lease takes at most LARGEST_SHARE of each limit (DAILY_SHARE of a daily budget), and about HORIZON_S of this
  process's demand on the scope;
- Redis grants one only while every limited dimension keeps KEEP of its limit afterwards; near a limit (or with
  limits too small to share out) each request is decided in Redis as before, after this process has given back
  what it held of those scopes, so near a limit decisions are exactly the strict ones;
- the next lease is taken ahead, when one is half used (or its last slot taken), and grants once that one cannot;
- a lease that stops granting (used up, replaced, idle for IDLE_S, its day over) gives back at once what it did not
  grant; what its requests did not use, and their slots, go back as they finish (lua.SETTLE, SETTLE_AFTER_S after
  the first is due, SETTLE_BATCH leases a call).
A hot tenant's slices (slices.py) share its buckets another way: those requests go to Redis as before.

A gateway killed while holding leases never gives them back: the per-minute buckets refill as after any spending, its
leases' slots (the free ones and those of its running requests) expire within SLOT_TTL_S, since only a living process
renews them (lua.REFRESH_SLOTS), and its leases' tokens stay counted for that day (DAILY_SHARE of the budget per lease
at most, two leases per scope: the one granting and the one taken ahead).

Reservations made here are reconciled here (a gateway reconciles what it reserved; they say `leased`); a second
reconcile of one is ignored, as Redis's marker does. The x-ratelimit-* headers of a decision made here are the
scope's levels when the lease was taken, refilled since, less what this process took from it since: other gateways'
use since then is not in them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeGuard

from tokenfleet.quota import lua
from tokenfleet.quota.base import Decision, Remaining, Reservation, Scope
from tokenfleet.quota.checked import CheckedQuota
from tokenfleet.quota.redis import RedisQuota, limit_numbers
from tokenfleet.quota.redis_client import UNREACHABLE, Script
from tokenfleet.quota.rules import DAY_S, ScopeState, day_name, decide

LEASE, SETTLE, REFRESH_SLOTS = Script(lua.LEASE), Script(lua.SETTLE), Script(lua.REFRESH_SLOTS)
HORIZON_S = 5.0  # a lease holds about this long of this process's demand on its scope
MIN_REQUESTS = 4  # the fewest requests a lease is worth taking for
DEMAND_TAU_S = 1.0  # the time constant of the demand's request rate (a gateway's demand follows its load quickly)
LARGEST_SHARE = 1 / 16  # of each limit, the most one lease takes
DAILY_SHARE = 1 / 256  # of a daily budget, the most one lease takes (a killed gateway's leases count as used today)
KEEP = 0.25  # Redis grants a lease only while each limited dimension keeps this share of its limit afterwards
IDLE_S = 5.0  # a lease that granted nothing for this long is given back
SETTLE_AFTER_S = 0.05  # what stopped leases hold goes back this soon (what comes due meanwhile goes with it)
CHECK_EVERY_S = 1.0  # how often leases are checked for idleness
SLOT_TTL_S = 60.0  # a lease's slots expire this long after they were last renewed (every quarter of it, while held)
SETTLE_BATCH = 64  # leases given back per script call (one call at a time: a lease being taken never waits long)
STRICT_FOR_S = 1.0  # after a lease was refused, a scope's requests go to Redis this long before trying again
log = logging.getLogger("tokenfleet.quota")


@dataclass(slots=True)
class _Demand:
    """This process's demand on one scope: requests per second and tokens per request, exponentially weighted."""

    rate: float = 0.0
    tokens: float = 0.0
    at: float = 0.0

    def note(self, now: float, tokens: int) -> None:
        self.rate = self.rate * math.exp(-max(0.0, now - self.at) / DEMAND_TAU_S) + 1 / DEMAND_TAU_S
        self.tokens = float(tokens) if not self.tokens else 0.8 * self.tokens + 0.2 * tokens
        self.at = now


@dataclass(frozen=True, slots=True)
class _Size:
    requests: int
    tokens: int
    slots: int


@dataclass(frozen=True, slots=True)
class _Seen:
    """The scope as Redis saw it when the lease was taken, before charging it (None: unlimited)."""

    requests: float | None
    tokens: float | None
    live: int | None
    used: int | None
    at: float  # Redis's clock


@dataclass(frozen=True, slots=True)
class _Settlement:
    """What a lease gives back in one SETTLE call; kept as it is until Redis has it (the marker makes a retry
    harmless)."""

    seq: int
    requests: int
    tokens: int
    slots: tuple[str, ...]


@dataclass(eq=False, slots=True)
class _Lease:
    scope: Scope
    id: str
    day: int  # the UTC day number it was charged on
    size: _Size
    seen: _Seen
    requests: int  # not granted yet (what comes back when it stops granting)
    tokens: int  # not granted yet, plus what finished requests did not use (less what they used beyond)
    free: list[str]  # its slots not in use (empty when concurrency is unlimited: `slotted` says)
    slotted: bool
    last_used: float
    granting: bool = True
    running: int = 0  # requests granted and not reconciled
    released: list[str] = field(default_factory=list)  # slots freed once it stopped granting, to give back
    pending: _Settlement | None = None
    settlements: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def grants(self, tokens: int, day: int) -> bool:
        return (
            self.granting
            and self.day == day
            and self.requests >= 1
            and self.tokens >= tokens
            and (not self.slotted or bool(self.free))
        )

    def take(self, tokens: int, now: float) -> str | None:
        self.requests -= 1
        self.tokens -= tokens
        self.running += 1
        self.last_used = now
        return self.free.pop() if self.slotted else None

    def give_back(self, reserved: int, used: int, slot: str | None) -> None:
        self.running -= 1
        self.tokens += reserved - used
        if slot is not None:
            (self.free if self.granting else self.released).append(slot)

    def low(self, tokens: float) -> bool:
        """Half used up (or its last slot taken): time to take the next one, while this one still grants."""
        return self.requests * 2 <= self.size.requests or self.tokens < 2 * tokens or (self.slotted and not self.free)

    def settlement(self) -> _Settlement | None:
        """What to give back now (the same one again until Redis has it); None: nothing."""
        if self.pending is None:
            slots = self.released + ([] if self.granting else self.free)
            requests, tokens = (0, 0) if self.granting else (self.requests, self.tokens)
            if not requests and not tokens and not slots:
                return None
            self.pending = _Settlement(next(self.settlements), requests, tokens, tuple(slots))
            self.released = []
            if not self.granting:
                self.requests = self.tokens = 0
                self.free = []
        return self.pending

    def unclaimed(self) -> tuple[int, int, int]:
        """Requests, tokens and slots it holds in Redis that no request here has: not granted, come back, or on their
        way back (its pending settlement)."""
        requests, tokens, slots = self.requests, self.tokens, len(self.free) + len(self.released)
        if self.pending is not None:
            requests, tokens = requests + self.pending.requests, tokens + self.pending.tokens
            slots += len(self.pending.slots)
        return requests, tokens, slots

    @property
    def done(self) -> bool:
        """Stopped granting, nothing running, everything given back."""
        return (
            not self.granting
            and not self.running
            and self.pending is None
            and not (self.released or self.free or self.requests or self.tokens)
        )

    def state(self, now: float) -> ScopeState:
        """The scope as this process sees it now, for a decision's headers."""
        lim, seen, size = self.scope.limits, self.seen, self.size
        refill = max(0.0, now - seen.at) / 60.0
        requests = tokens = None
        if lim.requests_per_minute is not None and seen.requests is not None:
            rpm = lim.requests_per_minute
            requests = min(float(rpm), min(float(rpm), seen.requests - size.requests + refill * rpm) + self.requests)
        if lim.tokens_per_minute is not None and seen.tokens is not None:
            tpm = lim.tokens_per_minute
            tokens = min(float(tpm), min(float(tpm), seen.tokens - size.tokens + refill * tpm) + self.tokens)
        live = None if seen.live is None else seen.live + self.running
        used = None if seen.used is None else seen.used + size.tokens - self.tokens
        return ScopeState(self.scope, lim, requests, tokens, live, used)


@dataclass(frozen=True, slots=True)
class _Granted:
    leases: tuple[_Lease, ...]
    slots: tuple[str | None, ...]


class LeasedQuota(CheckedQuota):
    """`inner`: the Redis quota it takes leases from, and decides with where leases do not serve."""

    name = "redis"  # its reservations are the Redis backend's (a failover reconciles them here)

    def __init__(
        self,
        inner: RedisQuota,
        *,
        horizon_s: float = HORIZON_S,
        largest_share: float = LARGEST_SHARE,
        keep: float = KEEP,
        idle_s: float = IDLE_S,
        settle_after_s: float = SETTLE_AFTER_S,
        slot_ttl_s: float = SLOT_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not horizon_s > 0 or not 0 < largest_share <= 1 or not 0 <= keep < 1 or not idle_s > 0:
            raise ValueError("horizon_s and idle_s must be positive, largest_share in (0, 1], keep in [0, 1)")
        self.inner, self.clock = inner, clock
        self.horizon_s, self.largest_share, self.keep = horizon_s, largest_share, keep
        self.idle_s, self.settle_after_s, self.slot_ttl_s = idle_s, settle_after_s, slot_ttl_s
        self.local_decisions = 0  # reserves decided from a lease (for metrics and tests)
        self._id = uuid.uuid4().hex[:16]
        self._numbers = itertools.count(1)
        self._leases: dict[str, _Lease] = {}  # scope name -> the lease that grants
        self._next: dict[str, _Lease] = {}  # scope name -> the one taken ahead, to grant once that one cannot
        self._stopped: set[_Lease] = set()  # leases that no longer grant, until done
        self._due: set[_Lease] = set()  # stopped leases with something to give back
        self._demand: dict[str, _Demand] = {}
        self._granted: dict[str, _Granted] = {}  # request id -> its leases and slots, until reconciled
        self._taking: dict[str, asyncio.Task[bool]] = {}  # scope name -> the lease being taken
        self._strict_until: dict[str, float] = {}  # scope name -> decided in Redis until then
        self._settler: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._checked = self._swept = self._renewed = 0.0

    @property
    def leases_held(self) -> int:
        """Leases granting, taken ahead, or stopped with something not yet given back."""
        return len(self._every())

    @property
    def free_slots(self) -> int:
        """Concurrency slots the leases hold in Redis that no request of this process is in."""
        return sum(lease.unclaimed()[2] for lease in self._every())

    def _every(self) -> tuple[_Lease, ...]:
        """Every lease held: granting, taken ahead, or stopped and not done."""
        return (*self._leases.values(), *self._next.values(), *self._stopped)

    async def _reserve(self, request_id: str, scopes: tuple[Scope, ...], tokens: int) -> Decision:
        now = self.clock()
        if self.inner.plan(scopes[0].tenant).sliced:
            return await self.inner.reserve(request_id, scopes, tokens)
        for scope in scopes:
            self._demand_of(scope).note(now, tokens)
        leases = self._grantable(scopes, tokens, now)
        if leases is None:
            leases = await self._take_leases(scopes, tokens)
        if leases is None:
            return await self.inner.reserve(request_id, scopes, tokens)
        return self._grant(request_id, scopes, tokens, leases)

    async def _reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        granted = self._granted.pop(reservation.request_id, None)
        if granted is None:
            if not reservation.leased:  # a leased one not held here was reconciled before
                await self.inner.reconcile(reservation, used_tokens)
            return
        for lease, slot in zip(granted.leases, granted.slots):
            lease.give_back(reservation.tokens, used_tokens, slot)
            if not lease.granting:
                self._settle_soon(lease)

    async def _extend(self, reservation: Reservation, at_least: int, at_most: int) -> Reservation | None:
        if reservation.leased and reservation.request_id not in self._granted:
            return None  # reconciled
        return await self.inner.extend(reservation, at_least, at_most)  # charged in Redis; its reconcile here

    async def remaining(self, scope: Scope) -> Remaining:
        """What `scope` has left now: Redis's levels plus what this process holds of it and has not granted."""
        left = await self.inner.remaining(scope)
        held = [lease.unclaimed() for lease in self._every() if lease.scope == scope]
        requests, tokens, slots = sum(h[0] for h in held), sum(h[1] for h in held), sum(h[2] for h in held)
        lim = scope.limits
        return Remaining(
            None if left.requests is None else min(left.requests + requests, _at_most(lim.requests_per_minute)),
            None if left.tokens is None else min(left.tokens + tokens, _at_most(lim.tokens_per_minute)),
            None if left.concurrent is None else left.concurrent + slots,
            None if left.tokens_today is None else left.tokens_today + tokens,
        )

    async def give_back(self) -> None:
        """Stops every lease and gives back what they hold (what running requests hold comes back as they end)."""
        await asyncio.gather(*self._taking.values(), return_exceptions=True)  # a lease being taken is held too
        for lease in [*self._leases.values(), *self._next.values()]:
            self._stop(lease)
        await self._settle_due()

    async def close(self) -> None:
        if self._settler is not None:
            self._settler.cancel()
            await asyncio.gather(self._settler, return_exceptions=True)
        for task in self._taking.values():
            task.cancel()
        await asyncio.gather(*self._taking.values(), return_exceptions=True)
        with contextlib.suppress(*UNREACHABLE):
            await self.give_back()
        held = [lease for lease in self._stopped if lease.pending is not None]
        if held:
            log.warning("quota: %d lease(s) could not be given back; Redis expires what they hold", len(held))
        await self.inner.close()

    def _demand_of(self, scope: Scope) -> _Demand:
        demand = self._demand.get(scope.name)
        if demand is None:
            demand = self._demand[scope.name] = _Demand()
        return demand

    def _grantable(self, scopes: tuple[Scope, ...], tokens: int, now: float) -> tuple[_Lease, ...] | None:
        """Every scope's lease, if each can grant this request now (the one taken ahead replacing one that cannot);
        takes the next one of a lease that runs low, while it still grants."""
        day = int(now // DAY_S)
        leases = []
        for scope in scopes:
            lease = self._leases.get(scope.name)
            if not _grants(lease, scope, tokens, day):
                ahead = self._next.get(scope.name)
                if ahead is None or not _grants(ahead, scope, tokens, day):
                    return None
                del self._next[scope.name]
                if lease is not None:
                    self._stop(lease)
                self._leases[scope.name] = lease = ahead
            leases.append(lease)
        for lease in leases:
            name = lease.scope.name
            if name not in self._next and name not in self._taking and lease.low(self._demand_of(lease.scope).tokens):
                self._start_taking(lease.scope, tokens)
        return tuple(leases)

    def _grant(self, request_id: str, scopes: tuple[Scope, ...], tokens: int, leases: tuple[_Lease, ...]) -> Decision:
        now = self.clock()
        states = [lease.state(now) for lease in leases]
        slots = tuple(lease.take(tokens, now) for lease in leases)
        self._granted[request_id] = _Granted(leases, slots)
        self.local_decisions += 1
        reservation = Reservation(request_id, scopes, tokens, day_name(leases[0].day), self.name, leased=True)
        return decide(states, tokens, reservation, now, self.inner.concurrency_retry_s)

    async def _take_leases(self, scopes: tuple[Scope, ...], tokens: int) -> tuple[_Lease, ...] | None:
        """The leases this request needs, taken now; None: it is to be decided in Redis. Where a scope is near its
        limits (a lease refused, or limits too small to share out), this process first gives back what it holds of
        that scope, so that Redis does not refuse the request on this process's account."""
        now = self.clock()
        day = int(now // DAY_S)
        lacking = [s for s in scopes if not self._can_grant(s, tokens, day)]
        if all(self._strict_until.get(s.name, 0.0) <= now and self._size(s, tokens) for s in lacking):
            taken = await asyncio.gather(*(self._taking_of(s, tokens) for s in lacking))
            if all(taken):
                # None: requests made meanwhile used them up; far from the limits (each lease kept KEEP), Redis decides
                return self._grantable(scopes, tokens, self.clock())
        held = [held for s in lacking for held in (self._leases.get(s.name), self._next.get(s.name)) if held]
        for lease in held:
            self._stop(lease)
        await self._settle_leases(held)
        return None

    def _can_grant(self, scope: Scope, tokens: int, day: int) -> bool:
        """Whether the scope's lease, or the one taken ahead, can grant `tokens` now."""
        return any(
            _grants(lease, scope, tokens, day) for lease in (self._leases.get(scope.name), self._next.get(scope.name))
        )

    def _size(self, scope: Scope, tokens: int) -> _Size | None:
        """The lease to take for `scope`, or None when its limits are too small to share out."""
        lim, demand = scope.limits, self._demand_of(scope)
        if 0 in limit_numbers(lim):  # refuses everything: Redis says so, with its reason
            return None
        requests = max(MIN_REQUESTS, math.ceil(demand.rate * self.horizon_s))
        budget = math.ceil(max(tokens, demand.tokens) * requests * 1.5)
        slots = 0
        if lim.requests_per_minute is not None:
            requests = min(requests, int(lim.requests_per_minute * self.largest_share))
        if lim.tokens_per_minute is not None:
            budget = min(budget, int(lim.tokens_per_minute * self.largest_share))
        if lim.tokens_per_day is not None:
            budget = min(budget, int(lim.tokens_per_day * DAILY_SHARE))
        if lim.concurrent_requests is not None:
            slots = min(requests, int(lim.concurrent_requests * self.largest_share))
            if slots < 1:
                return None
        if requests < 2 or budget < tokens:
            return None
        return _Size(requests, budget, slots)

    def _taking_of(self, scope: Scope, tokens: int) -> asyncio.Future[bool]:
        task = self._taking.get(scope.name)
        if task is None:
            task = self._start_taking(scope, tokens)
        return asyncio.shield(task)

    def _start_taking(self, scope: Scope, tokens: int) -> asyncio.Task[bool]:
        task = asyncio.get_running_loop().create_task(self._take(scope, tokens))
        self._taking[scope.name] = task
        task.add_done_callback(lambda done: self._taken(scope.name, done))
        return task

    def _taken(self, name: str, task: asyncio.Task[bool]) -> None:
        if self._taking.get(name) is task:
            del self._taking[name]
        if not task.cancelled() and task.exception() is not None:
            log.debug("quota: a lease of %s could not be taken: %r", name, task.exception())

    async def _take(self, scope: Scope, tokens: int) -> bool:
        """Takes a lease of `scope` from Redis: it grants next, once the scope's lease cannot (at once if none)."""
        size = self._size(scope, tokens)
        if size is None:
            return False
        plan = self.inner.plan(scope.tenant)
        hash_key, zset_key = self.inner.scope_keys(plan, scope)
        lease_id = f"lease:{self._id}:{next(self._numbers)}"
        reply = await self.inner.store.run(
            LEASE,
            [hash_key, zset_key],
            [f"{lease_id}#", size.requests, size.tokens, size.slots, repr(self.slot_ttl_s), self.inner.lease_s]
            + [repr(self.keep)]
            + list(limit_numbers(scope.limits)),
        )
        now = self.clock()
        if reply[0] != 1:
            self._strict_until[scope.name] = now + STRICT_FOR_S
            return False
        seen = _Seen(_float(reply[3]), _float(reply[4]), reply[5], reply[6], float(reply[1]))
        lease = _Lease(
            scope,
            lease_id,
            int(reply[2]),
            size,
            seen,
            size.requests,
            size.tokens,
            [f"{lease_id}#{i}" for i in range(size.slots, 0, -1)],
            size.slots > 0,
            now,
        )
        current = self._leases.get(scope.name)
        if current is not None and current.scope == scope and current.granting:
            earlier = self._next.get(scope.name)
            if earlier is not None:
                self._stop(earlier)
            self._next[scope.name] = lease
        else:
            self._leases[scope.name] = lease
            if current is not None:
                self._stop(current)
        self._ensure_settler()
        return True

    def _stop(self, lease: _Lease) -> None:
        """The lease grants no more; what it holds goes back soon."""
        lease.granting = False
        name = lease.scope.name
        if self._leases.get(name) is lease:
            del self._leases[name]
        if self._next.get(name) is lease:
            del self._next[name]
        self._stopped.add(lease)
        self._settle_soon(lease)

    def _settle_soon(self, lease: _Lease) -> None:
        self._due.add(lease)
        self._wake.set()
        self._ensure_settler()

    def _ensure_settler(self) -> None:
        if self._settler is None or self._settler.done():
            self._settler = asyncio.get_running_loop().create_task(self._settle_forever())

    async def _settle_forever(self) -> None:
        """Gives back what stopped leases hold, SETTLE_AFTER_S after the first of them is due (what comes due
        meanwhile goes in the same round of calls); stops leases that are idle or of a past day."""
        while self._leases or self._next or self._stopped:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), min(CHECK_EVERY_S, self.slot_ttl_s / 4))
            await asyncio.sleep(self.settle_after_s)
            self._wake.clear()
            now = self.clock()
            if now - self._checked >= CHECK_EVERY_S:
                self._checked = now
                self._stop_unused(now)
            try:
                if now - self._renewed >= self.slot_ttl_s / 4:
                    await self._renew_slots()
                    self._renewed = now
                await self._settle_due()
            except UNREACHABLE as e:  # kept due: given back once Redis is reachable again
                log.debug("quota: leases could not be given back yet: %r", e)
                await asyncio.sleep(CHECK_EVERY_S)
            self._sweep(now)

    async def _renew_slots(self) -> None:
        """Renews the slots every lease holds (SETTLE_BATCH leases a call), so that only a gateway that died lets
        its leases' slots expire."""
        slotted = [lease for lease in self._every() if lease.slotted]
        for start in range(0, len(slotted), SETTLE_BATCH):
            batch = slotted[start : start + SETTLE_BATCH]
            keys = [self.inner.scope_keys(self.inner.plan(lease.scope.tenant), lease.scope)[1] for lease in batch]
            args: list[str | int] = [repr(self.slot_ttl_s)]
            for lease in batch:
                args += [f"{lease.id}#", lease.size.slots]
            await self.inner.store.run(REFRESH_SLOTS, keys, args)

    def _stop_unused(self, now: float) -> None:
        day = int(now // DAY_S)
        for lease in [*self._leases.values(), *self._next.values()]:
            if lease.day != day or now - lease.last_used > self.idle_s:
                self._stop(lease)

    async def _settle_due(self) -> None:
        """Gives back what the due leases hold, SETTLE_BATCH at a time (one script call each)."""
        due, self._due = list(self._due), set()
        try:
            for start in range(0, len(due), SETTLE_BATCH):
                await self._settle_leases(due[start : start + SETTLE_BATCH])
        except BaseException:
            self._due.update(lease for lease in due if not lease.done)
            raise

    async def _settle_leases(self, leases: list[_Lease]) -> None:
        """One SETTLE call for what these leases have to give back (a lease's settlement is kept until Redis has
        it: its marker makes a second delivery harmless)."""
        settling = [(lease, settlement) for lease in leases if (settlement := lease.settlement()) is not None]
        if settling:
            keys: list[str] = []
            args: list[str | int] = [self.inner.marker_ttl_s]
            for lease, settlement in settling:
                plan = self.inner.plan(lease.scope.tenant)
                keys += self.inner.scope_keys(plan, lease.scope)
                keys.append(self.inner.store.key(plan.tag, "reconciled", f"{lease.id}:{settlement.seq}"))
                args += [settlement.requests, settlement.tokens, lease.day, *limit_numbers(lease.scope.limits)]
                args.append(len(settlement.slots))
                args += settlement.slots
            await self.inner.store.run(SETTLE, keys, args)
            for lease, settlement in settling:
                if lease.pending is settlement:
                    lease.pending = None
        for lease in leases:
            if lease.done:
                self._stopped.discard(lease)

    def _sweep(self, now: float) -> None:
        if now - self._swept < 60.0:
            return
        self._swept = now
        self._strict_until = {name: until for name, until in self._strict_until.items() if until > now}
        idle = now - 10 * self.idle_s
        self._demand = {name: d for name, d in self._demand.items() if d.at > idle}


def _grants(lease: _Lease | None, scope: Scope, tokens: int, day: int) -> TypeGuard[_Lease]:
    """Whether `lease` is one of `scope` as it is now (its limits unchanged) and can grant `tokens` today."""
    return lease is not None and lease.scope == scope and lease.grants(tokens, day)


def _at_most(limit: int | None) -> float:
    """A bucket never holds more than its limit (what comes back to a full one is lost, as a refund to it is)."""
    return math.inf if limit is None else float(limit)


def _float(value: bytes | None) -> float | None:
    return None if value is None else float(value)
