"""Usage and cost from the warehouse table (`usage_events`): totals by any of organisation, user, model, tier and
day, priced with the price table; and the cost of serving a million output tokens per model and tier, from the
replica time the requests used (each request's share of its replica's busy time) at the replica-hour price."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import date

from sqlalchemy import func, select

from tokenfleet.billing.prices import PriceTable
from tokenfleet.store.db import Database
from tokenfleet.store.models import UsageEventRow

GROUPS = ("org", "user", "model", "tier", "day")
COLUMNS = {
    "org": UsageEventRow.org_id,
    "user": UsageEventRow.user_id,
    "model": UsageEventRow.model,
    "tier": UsageEventRow.tier,
    "day": UsageEventRow.day,
}


@dataclass(frozen=True)
class UsageFilter:
    org: str | None = None
    user: str | None = None
    model: str | None = None
    since: date | None = None  # first day included (UTC)
    until: date | None = None  # last day included (UTC)

    def clauses(self) -> list:
        where = [
            COLUMNS[name] == value
            for name, value in (("org", self.org), ("user", self.user), ("model", self.model))
            if value is not None
        ]
        if self.since is not None:
            where.append(UsageEventRow.day >= self.since)
        if self.until is not None:
            where.append(UsageEventRow.day <= self.until)
        return where


@dataclass
class UsageLine:
    group: dict[str, str]  # e.g. {"org": ..., "model": ..., "day": "2026-11-30"}
    requests: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    cost_usd: float = 0.0

    def as_dict(self) -> dict:
        return {**self.group, **{k: v for k, v in asdict(self).items() if k != "group"}}


@dataclass
class UnitCost:
    model: str
    tier: str
    output_tokens: int
    engine_s: float  # replica seconds the requests used
    cost_per_million_output_usd: float | None  # None when no output token was produced


@dataclass
class Report:
    lines: list[UsageLine] = field(default_factory=list)

    @property
    def total_cost_usd(self) -> float:
        return sum(line.cost_usd for line in self.lines)


def check_groups(groups: list[str]) -> list[str]:
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        raise ValueError(f"group by one or more of {', '.join(GROUPS)} (got {', '.join(groups) or 'nothing'})")
    return list(dict.fromkeys(groups))


async def usage_report(db: Database, prices: PriceTable, groups: list[str], where: UsageFilter) -> Report:
    """Token totals and cost per group. Cost is priced per model, so each line is summed from per-model parts."""
    groups = check_groups(groups)
    keys = [COLUMNS[g].label(g) for g in dict.fromkeys([*groups, "model"])]
    sums = [
        func.count().label("requests"),
        func.sum(UsageEventRow.input_tokens),
        func.sum(UsageEventRow.cached_tokens),
        func.sum(UsageEventRow.output_tokens),
    ]
    query = select(*keys, *sums).where(*where.clauses()).group_by(*keys)
    async with db.session() as session:
        rows = (await session.execute(query)).all()
    lines: dict[tuple, UsageLine] = {}
    for row in rows:
        values = row._mapping
        group = {g: str(values[g]) for g in groups}
        line = lines.setdefault(tuple(group.values()), UsageLine(group, 0, 0, 0, 0))
        requests, input_tokens, cached, output = (int(v or 0) for v in row[len(keys) :])
        line.requests += requests
        line.input_tokens += input_tokens
        line.cached_tokens += cached
        line.output_tokens += output
        line.cost_usd += prices.price(values["model"]).cost(input_tokens, cached, output)
    return Report(sorted(lines.values(), key=lambda line: tuple(line.group.values())))


async def unit_costs(db: Database, replica_hour_usd: float, where: UsageFilter) -> list[UnitCost]:
    """Per model and tier: replica seconds used x the replica-hour price / output tokens x one million. Idle
    replica time is not in it (no request used it): this is the cost of the work, not of the fleet."""
    keys = [UsageEventRow.model, UsageEventRow.tier]
    query = (
        select(*keys, func.sum(UsageEventRow.output_tokens), func.sum(UsageEventRow.engine_s))
        .where(*where.clauses())
        .group_by(*keys)
        .order_by(*keys)
    )
    async with db.session() as session:
        rows = (await session.execute(query)).all()
    costs = []
    for model, tier, output, engine_s in rows:
        output, engine_s = int(output or 0), float(engine_s or 0.0)
        per_million = engine_s * replica_hour_usd / 3600 / output * 1e6 if output else None
        costs.append(UnitCost(model, tier, output, engine_s, per_million))
    return costs
