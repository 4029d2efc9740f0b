"""A request's usage event, built from what the gateway saw: who asked, where the router sent it, the replica's
token counts (so far, for a request still running or cut short) and the gateway's own clock."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Protocol

from tokenfleet.api.usage import Usage
from tokenfleet.gateway.auth import Caller
from tokenfleet.gateway.relay import Relay
from tokenfleet.metering.event import UsageEvent
from tokenfleet.store.models import utcnow


def usage_event(
    request_id: str,
    model: str,
    caller: Caller,
    arrived: float,
    relay: Relay | None,
    status: str | None = None,
    prompt_tokens: int = 0,
) -> UsageEvent:
    """`arrived` is the request's time.monotonic() at the gateway; `status` overrides the relay's (a request
    that never reached a relay: refused by the safety hook, or its client left while it queued). `prompt_tokens`:
    the gateway's own count, for a request the replica has not reported on yet."""
    now, usage = time.monotonic(), (relay.usage if relay else None) or Usage()
    input_tokens = max(prompt_tokens, usage.prompt_tokens)
    route, principal = relay.route if relay else None, caller.principal
    first = relay.first_token_at if relay else None
    ended_at = utcnow()
    return UsageEvent(
        request_id=request_id,
        org_id=principal.org_id,
        user_id=principal.user_id,
        key_id=principal.key_id,
        model=model,
        replica=getattr(route, "replica", ""),
        pool=getattr(route, "pool", ""),
        tier=principal.tier,
        input_tokens=input_tokens,  # a continuation after failover can hit the cache past the original prompt:
        cached_tokens=min(input_tokens, usage.cached_tokens),
        output_tokens=usage.completion_tokens,
        ttft_s=None if first is None else first - arrived,
        latency_s=now - arrived,
        status=status or (relay.status if relay else "failed"),
        route=route.describe()[:500] if route is not None and route.replica else "",
        started_at=ended_at - timedelta(seconds=now - arrived),
        ended_at=ended_at,
        engine_s=usage.engine_s,
    )


class UsageSource(Protocol):
    async def last_usage(self, request_id: str) -> Usage | None: ...


def reconciler(source: UsageSource) -> Callable[[UsageEvent], Awaitable[UsageEvent]]:
    """For the reaper: a dead gateway's request, billed with what its replica had reported when it stopped (the
    resume stream keeps every report) where that is more than the row's last checkpoint."""

    async def reconcile(event: UsageEvent) -> UsageEvent:
        return with_usage(event, await source.last_usage(event.request_id))

    return reconcile


def with_usage(event: UsageEvent, usage: Usage | None) -> UsageEvent:
    """The event with the counts of a replica's usage report where they are higher."""
    if usage is None:
        return event
    input_tokens = max(event.input_tokens, usage.prompt_tokens)
    return dataclasses.replace(
        event,
        input_tokens=input_tokens,
        cached_tokens=min(input_tokens, max(event.cached_tokens, usage.cached_tokens)),
        output_tokens=max(event.output_tokens, usage.completion_tokens),
        engine_s=max(event.engine_s, usage.engine_s),
    )
