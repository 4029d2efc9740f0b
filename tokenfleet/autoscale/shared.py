"""Gateways add up their shares of the autoscaler's signals through Redis.

Every gateway reads the same replica reports (in flight, KV usage, queued prefill), but each sees only its own fair
queue and its own arrivals. Deciding on those alone, each of N gateways would see 1/N of the arrival rate (and
forecast from it) and count the other gateways' batch work on the replicas as interactive demand. So every
autoscaler step a gateway writes its shares and reads every live gateway's, in one script, and decides on the
sum; every gateway then decides on the same totals, and the maximum a KEDA query takes over them is right.

Keys, kept with the replica registry's script pieces (a sorted set of expiry times on the Redis server's clock plus
a hash of records, in one cluster slot), under the fleet's registry prefix:
  {prefix}{gateways}:live     sorted set: gateway id -> expiry time
  {prefix}{gateways}:shares   hash: gateway id -> its shares, JSON {pool key: GatewayShare fields}
A gateway that stops writing drops out after ttl_s; both keys expire when every gateway has gone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import uuid

from tokenfleet.autoscale.signals import GatewayShare, add_shares
from tokenfleet.router.registry import (
    LIVE_RECORDS,
    REDIS_FAILURES,
    REDIS_NOW,
    UPSERT_RECORD,
    Outage,
    Script,
    check_prefix,
    run_script,
)

log = logging.getLogger(__name__)

# KEYS: live, shares. ARGV: gateway id, its shares JSON, ttl seconds. Returns every live gateway's shares, this
# one's (just written) included.
_EXCHANGE = Script(REDIS_NOW + UPSERT_RECORD + LIVE_RECORDS)


def gateway_id() -> str:
    """Unique per gateway process, and says where it runs."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class SharedShares:
    def __init__(self, redis, prefix: str, ttl_s: float, me: str | None = None) -> None:
        check_prefix(prefix)
        self.redis, self.ttl_s, self.me = redis, ttl_s, me or gateway_id()
        self.keys = [f"{prefix}{{gateways}}:live", f"{prefix}{{gateways}}:shares"]
        self._outage = Outage("autoscaler signal exchange")

    async def total(self, mine: dict[str, GatewayShare]) -> dict[str, GatewayShare]:
        """Writes this gateway's shares; returns every live gateway's added up per pool (this one's alone when
        Redis cannot be reached: a partial view beats none)."""
        payload = json.dumps({key: dataclasses.asdict(share) for key, share in mine.items()}, sort_keys=True)
        try:
            raw = await run_script(self.redis, _EXCHANGE, self.keys, [self.me, payload, repr(float(self.ttl_s))])
        except REDIS_FAILURES as e:
            self._outage.failed(e)
            return dict(mine)
        self._outage.ok()
        return add_shares(*(_decode(value) for value in raw))


def _decode(value: bytes | str) -> dict[str, GatewayShare]:
    """Another gateway's shares; fields this version does not know (a newer gateway's) are ignored."""
    try:
        data = json.loads(value)
        known = {f.name for f in dataclasses.fields(GatewayShare)}
        return {key: GatewayShare(**{k: v for k, v in fields.items() if k in known}) for key, fields in data.items()}
    except (ValueError, TypeError, AttributeError) as e:
        log.warning("ignoring unreadable autoscaler shares from another gateway: %r", e)
        return {}
