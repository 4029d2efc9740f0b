"""The rebalance task of a hot tenant: moves per-minute bucket shares between its slices toward recent demand
(the design is in slices.py)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from tokenfleet.quota import lua
from tokenfleet.quota.base import QuotaStoreError
from tokenfleet.quota.redis_client import RedisStore, Script, text
from tokenfleet.quota.slices import SlicePlan, apply_order, target_shares

log = logging.getLogger("tokenfleet.quota")
TAKE_DEMAND, SET_SHARE = Script(lua.TAKE_DEMAND), Script(lua.SET_SHARE)


class Rebalancer:
    def __init__(self, store: RedisStore, tenant: str, count: int, min_share: float, interval_s: float) -> None:
        self.store, self.tenant, self.count = store, tenant, count
        self.interval_s = interval_s
        self.plans = [SlicePlan(tenant, k, count, min_share) for k in range(count)]
        self.rounds = 0  # rounds this gateway ran (it took the lock)

    def share_key(self, plan: SlicePlan) -> str:
        return self.store.key(plan.tag, "share")

    async def rebalance_once(self) -> list[float] | None:
        """One round; the new shares, or None when another gateway holds this interval's lock."""
        started = time.monotonic()
        lock_ms = max(1, int(self.interval_s * 1000))
        lock = self.store.key(self.tenant, "rebalance-lock")
        if not await self.store.command("SET", lock, secrets.token_hex(8), "NX", "PX", lock_ms):
            return None
        s0 = self.plans[0].initial_share
        current, demand = [], []
        for plan in self.plans:
            share, taken = text(await self.store.run(TAKE_DEMAND, [self.share_key(plan)], [s0])).split(" ")
            current.append(float(share))
            demand.append(float(taken))
        target = target_shares(demand, current, self.plans[0].floor)
        for k in apply_order(current, target):
            if target[k] > current[k] and time.monotonic() - started > self.interval_s / 2:
                # so late that the lock may lapse: growing now could overlap the next round; that round tops up
                log.warning("quota rebalance of %s stopped before growing shares: round too slow", self.tenant)
                break
            await self.store.run(SET_SHARE, [self.share_key(self.plans[k])], [repr(target[k]), s0])
        self.rounds += 1
        return target

    async def run(self) -> None:
        """Rounds every interval until cancelled (also when a library swallowed the cancellation on the way)."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("the quota rebalancer must run as an asyncio task")
        while not task.cancelling():
            await asyncio.sleep(self.interval_s)
            try:
                await self.rebalance_once()
            except QuotaStoreError as e:
                log.debug("quota rebalance of %s skipped: %s", self.tenant, e)
            except Exception:
                log.exception("quota rebalance of %s failed", self.tenant)
