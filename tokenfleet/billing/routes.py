"""Usage over HTTP: `GET /v1/usage` (the caller's own organisation) and, for operators, `GET /admin/v1/usage`
(any organisation) and `GET /admin/v1/usage/costs` (cost per million output tokens by model and tier)."""

from __future__ import annotations

from datetime import date

from fastapi import APIRouter, Depends, FastAPI, Request

from tokenfleet.api.errors import bad_request
from tokenfleet.billing.report import UsageFilter, check_groups, unit_costs, usage_report
from tokenfleet.billing.settings import BillingSettings
from tokenfleet.gateway.admin import PREFIX, admin_guard
from tokenfleet.gateway.gateway import Gateway
from tokenfleet.store.db import Database

DEFAULT_GROUPS = "day,model"


def add_usage_routes(
    app: FastAPI, gateway: Gateway, db: Database, billing: BillingSettings, admin_key: str | None
) -> None:
    @app.get("/v1/usage")
    async def own_usage(request: Request) -> dict:
        """Usage of the caller's organisation (never another's): by day and model unless group_by says."""
        caller = await gateway.auth.caller(request)
        where = usage_filter(request, org=caller.tenant)
        return await report(db, billing, request, where)

    admin = APIRouter(prefix=PREFIX, dependencies=[Depends(admin_guard(admin_key))])

    @admin.get("/usage")
    async def any_usage(request: Request) -> dict:
        return await report(db, billing, request, usage_filter(request, org=request.query_params.get("org")))

    @admin.get("/usage/costs")
    async def costs(request: Request) -> dict:
        lines = await unit_costs(db, billing.replica_hour_usd, usage_filter(request, request.query_params.get("org")))
        return {"object": "list", "replica_hour_usd": billing.replica_hour_usd, "data": [vars(line) for line in lines]}

    app.include_router(admin)


async def report(db: Database, billing: BillingSettings, request: Request, where: UsageFilter) -> dict:
    groups = request.query_params.get("group_by", DEFAULT_GROUPS).split(",")
    try:
        groups = check_groups([g.strip() for g in groups if g.strip()])
    except ValueError as e:
        raise bad_request(str(e), param="group_by") from None
    result = await usage_report(db, billing.table, groups, where)
    return {
        "object": "list",
        "group_by": groups,
        "data": [line.as_dict() for line in result.lines],
        "total_cost_usd": result.total_cost_usd,
    }


def usage_filter(request: Request, org: str | None) -> UsageFilter:
    params = request.query_params
    return UsageFilter(
        org=org,
        user=params.get("user"),
        model=params.get("model"),
        since=_day(params.get("since"), "since"),
        until=_day(params.get("until"), "until"),
    )


def _day(value: str | None, name: str) -> date | None:
    if value is None:
        return None
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise bad_request(f"{name} must be a day as YYYY-MM-DD, got {value!r}", param=name) from None
