"""`tokenfleet usage`: tokens and cost by organisation, user, model, tier and day, or (--costs) the cost of a
million output tokens by model and tier, from the configured database's warehouse table."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import date

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from tokenfleet.billing.report import UsageFilter, check_groups, unit_costs, usage_report
from tokenfleet.commands.database import add_database_arguments, resolve_database_url
from tokenfleet.store.db import Database
from tokenfleet.store.models import Organisation, User
from tokenfleet.store.tenants import TenantStore
from tokenfleet.table import print_table

COUNTS = ("requests", "input_tokens", "cached_tokens", "output_tokens")
NAMED = {"org": Organisation, "user": User}  # grouped by these, a line shows the name with the id beside it


def add_usage_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--by",
        default="org,model,day",
        help="group by a comma-separated list of org, user, model, tier, day (default org,model,day)",
    )
    parser.add_argument("--org", default=None, help="only this organisation (name or id)")
    parser.add_argument("--user", default=None, help="only this user id")
    parser.add_argument("--model", default=None, help="only this model (the served version)")
    parser.add_argument("--since", type=date.fromisoformat, default=None, help="first day, YYYY-MM-DD (UTC)")
    parser.add_argument("--until", type=date.fromisoformat, default=None, help="last day, YYYY-MM-DD (UTC)")
    parser.add_argument(
        "--costs",
        action="store_true",
        help="cost per million output tokens by model and tier (billing.replica_hour_usd)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_database_arguments(parser, "its database_url and billing prices")


def run_usage_command(args: argparse.Namespace) -> int:
    from tokenfleet.config import BillingSettings, FleetConfig

    billing = FleetConfig.load(args.config).billing if args.config else BillingSettings()
    groups = check_groups([g.strip() for g in args.by.split(",") if g.strip()])
    db = Database(resolve_database_url(args.database_url, args.config, args.data_dir))
    try:
        return asyncio.run(_run(args, db, billing, groups))
    except (OSError, SQLAlchemyError) as e:
        print(f"error: cannot use the database {db.url!r}: {e}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace, db: Database, billing, groups: list[str]) -> int:
    async with db:
        await db.migrate()
        org = args.org
        if org is not None:  # a name or an id; usage is stored by id
            found = await TenantStore(db).get_org(org)
            org = found.id if found else org
        where = UsageFilter(org, args.user, args.model, args.since, args.until)
        if args.costs:
            lines = [vars(line) for line in await unit_costs(db, billing.replica_hour_usd, where)]
            _print(args, lines, ["model", "tier", "output_tokens", "engine_s", "cost_per_million_output_usd"])
        else:
            report = await usage_report(db, billing.table, groups, where)
            lines = [line.as_dict() for line in report.lines]
            named = await _with_names(db, lines, [g for g in groups if g in NAMED])
            _print(args, lines if args.json else named, [*groups, *COUNTS, "cost_usd"])
            if not args.json and report.lines:
                print(f"total cost: ${report.total_cost_usd:.6f}")
    return 0


async def _with_names(db: Database, lines: list[dict], named: list[str]) -> list[dict]:
    """Adds `org_name` / `user_name` beside the ids (JSON), and returns the lines as a table shows them: the name
    first, its id beside it."""
    if not named:
        return lines
    async with db.session() as session:
        names = {
            column: dict((await session.execute(select(NAMED[column].id, NAMED[column].name))).tuples().all())
            for column in named
        }
    shown = []
    for line in lines:
        row = dict(line)
        for column in named:
            name = names[column].get(line[column])
            line[f"{column}_name"] = name
            row[column] = f"{name} ({line[column]})" if name else line[column]
        shown.append(row)
    return shown


def _print(args: argparse.Namespace, lines: list[dict], columns: list[str]) -> None:
    if args.json:
        print(json.dumps(lines, default=str, indent=2))
    elif not lines:
        print("no usage recorded for this selection")
    else:
        print_table([c.upper() for c in columns], [[_cell(line[c]) for c in columns] for line in lines])


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6f}"
    return "-" if value is None else str(value)
