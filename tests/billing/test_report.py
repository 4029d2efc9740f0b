"""Prices and the usage report over the warehouse table, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.metering.helpers import START, event
from tokenfleet.billing.prices import ModelPrice, PriceTable
from tokenfleet.billing.report import UsageFilter, check_groups, unit_costs, usage_report
from tokenfleet.metering.sql import insert_ignoring
from tokenfleet.metering.warehouse import WAREHOUSE, warehouse_row
from tokenfleet.store.db import Database

pytestmark = pytest.mark.anyio
PRICES = PriceTable.from_dict({"big": {"input": 2.0, "cached_input": 1.0, "output": 8.0}, "*": {"output": 1.0}})


def test_a_price_counts_cached_input_at_its_own_rate():
    assert ModelPrice(2.0, 1.0, 8.0).cost(1000, 400, 100) == pytest.approx((600 * 2 + 400 * 1 + 100 * 8) / 1e6)
    assert PRICES.price("small") == ModelPrice(output=1.0)  # the "*" entry
    assert PriceTable.from_dict({"m": {"input": 3}}).price("m").cached_input == 3  # defaults to the input price


@pytest.mark.parametrize("bad", [{"m": {"input": -1}}, {"m": {"output": "cheap"}}, {"m": {"inptu": 1}}, {"m": 5}])
def test_bad_prices_are_refused_with_the_model_named(bad):
    with pytest.raises(ValueError, match="prices.m"):
        PriceTable.from_dict(bad)


def test_unknown_groups_are_refused():
    with pytest.raises(ValueError, match="group by"):
        check_groups(["planet"])


async def seed(db: Database) -> None:
    rows = [
        event(
            1,
            org_id="a",
            user_id="u1",
            model="big",
            tier="paid",
            input_tokens=1000,
            cached_tokens=400,
            output_tokens=100,
            engine_s=2.0,
        ),
        event(
            2,
            org_id="a",
            user_id="u2",
            model="small",
            tier="free",
            input_tokens=10,
            cached_tokens=0,
            output_tokens=50,
            engine_s=0.5,
        ),
        event(
            3,
            org_id="b",
            user_id="u3",
            model="big",
            tier="paid",
            input_tokens=100,
            cached_tokens=0,
            output_tokens=300,
            engine_s=1.0,
            started_at=START + timedelta(days=1),
            ended_at=START + timedelta(days=1, seconds=1),
        ),
    ]
    async with db.session() as session, session.begin():
        await insert_ignoring(session, WAREHOUSE, [warehouse_row(e) for e in rows], key="request_id")


async def test_usage_by_org_sums_tokens_and_prices_each_model(db: Database):
    await seed(db)
    report = await usage_report(db, PRICES, ["org"], UsageFilter())
    lines = {line.group["org"]: line for line in report.lines}
    assert (lines["a"].requests, lines["a"].input_tokens, lines["a"].output_tokens) == (2, 1010, 150)
    assert lines["a"].cost_usd == pytest.approx((600 * 2 + 400 + 100 * 8) / 1e6 + 50 / 1e6)
    assert lines["b"].cost_usd == pytest.approx((100 * 2 + 300 * 8) / 1e6)
    assert report.total_cost_usd == pytest.approx(lines["a"].cost_usd + lines["b"].cost_usd)


async def test_usage_filters_by_org_user_model_and_day(db: Database):
    await seed(db)
    by_day = await usage_report(db, PRICES, ["day", "user"], UsageFilter(org="a"))
    assert [(line.group["user"], line.requests) for line in by_day.lines] == [("u1", 1), ("u2", 1)]
    later = await usage_report(db, PRICES, ["org"], UsageFilter(since=(START + timedelta(days=1)).date()))
    assert [line.group["org"] for line in later.lines] == ["b"]
    assert (await usage_report(db, PRICES, ["org"], UsageFilter(model="nothing"))).lines == []


async def test_cost_per_million_output_tokens_by_model_and_tier(db: Database):
    await seed(db)
    costs = {(c.model, c.tier): c for c in await unit_costs(db, 3.6, UsageFilter())}
    big = costs[("big", "paid")]
    assert (big.output_tokens, big.engine_s) == (400, pytest.approx(3.0))
    assert big.cost_per_million_output_usd == pytest.approx(3.0 * 3.6 / 3600 / 400 * 1e6)
    assert costs[("small", "free")].cost_per_million_output_usd == pytest.approx(0.5 * 3.6 / 3600 / 50 * 1e6)
