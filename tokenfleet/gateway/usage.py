"""A request's usage event, built from what the gateway saw: who asked, where the router sent it, the replica's
token counts (so far, for a request still running or cut short) and the gateway's own clock."""
from __future__ import annotations

import time
from datetime import timedelta

from tokenfleet.gateway.auth import Caller
from tokenfleet.gateway.relay import Relay
from tokenfleet.metering.event import UsageEvent
from tokenfleet.store.models import utcnow


def usage_event(request_id: str, model: str, caller: Caller, arrived: float, relay: Relay | None,
                status: str | None = None) -> UsageEvent:
    """`arrived` is the request's time.monotonic() at the gateway; `status` overrides the relay's (a request
    that never reached a relay: refused by the safety hook, or its client left while it queued)."""
    now, usage = time.monotonic(), (relay.usage if relay else None) or {}
    input_tokens = usage.get("prompt_tokens", 0)
    route, principal = relay.route if relay else None, caller.principal
    first = relay.first_token_at if relay else None
    ended_at = utcnow()
    return UsageEvent(
        request_id=request_id, org_id=principal.org_id, user_id=principal.user_id, key_id=principal.key_id,
        model=model, replica=getattr(route, "replica", ""), pool=getattr(route, "pool", ""), tier=principal.tier,
        input_tokens=input_tokens,  # a continuation after failover can hit the cache past the original prompt:
        cached_tokens=min(input_tokens, (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
        output_tokens=usage.get("completion_tokens", 0), ttft_s=None if first is None else first - arrived,
        latency_s=now - arrived, status=status or (relay.status if relay else "failed"),
        route=route.describe()[:500] if route is not None and route.replica else "",
        started_at=ended_at - timedelta(seconds=now - arrived), ended_at=ended_at,
        engine_s=float(usage.get("engine_s", 0.0)))
