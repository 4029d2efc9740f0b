"""`tokenfleet keys create | list | revoke`: API keys from the command line, against the configured database."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Collection
from datetime import datetime

from sqlalchemy.exc import SQLAlchemyError

from tokenfleet.commands.database import resolve_database_url
from tokenfleet.store.db import Database
from tokenfleet.store.records import KeyInfo
from tokenfleet.store.tenants import TenantStore
from tokenfleet.table import print_table

COLUMNS = ("ID", "PREFIX", "ORG", "USER", "NAME", "CREATED", "LAST USED", "STATUS")


def tier_names(config_path: str | None) -> Collection[str]:
    from tokenfleet.config import FleetConfig
    from tokenfleet.dispatch.tiers import default_tiers

    return FleetConfig.load(config_path).tiers if config_path else default_tiers()


def run_keys_command(args: argparse.Namespace) -> int:
    try:
        url = resolve_database_url(args.database_url, args.config, args.data_dir)
        tiers = tier_names(args.config)
        db = Database(url)
    except (OSError, ValueError, TypeError) as e:  # a bad --config file or database URL
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(_run(args, db, tiers))
    except (ValueError, LookupError) as e:  # refused input: the store's messages say what was wrong
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (OSError, SQLAlchemyError) as e:
        print(f"error: cannot use the database {db.url!r}: {e}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace, db: Database, tiers: Collection[str]) -> int:
    async with db:
        await db.migrate()
        store = TenantStore(db, tiers)
        if args.keys_action == "create":
            return await create(store, args)
        if args.keys_action == "list":
            print_keys(await store.list_keys(args.org))
            return 0
        return await revoke(store, args.key_id)


async def create(store: TenantStore, args: argparse.Namespace) -> int:
    info, plaintext = await store.create_key(args.org, args.user, args.name, args.tier)
    org = await store.get_org(info.org_id)
    print(
        f"created {info.id} ({info.name!r}) for user {info.user_name!r} of organisation {info.org_name!r} "
        f"(tier {org.tier})"
    )
    print(plaintext)
    print("This key will not be shown again: store it somewhere safe now.")
    return 0


async def revoke(store: TenantStore, key_id: str) -> int:
    if not await store.revoke_key(key_id):
        print(f"error: no API key with id {key_id!r}", file=sys.stderr)
        return 1
    print(f"revoked {key_id}")
    return 0


def _when(moment: datetime | None) -> str:
    return "-" if moment is None else moment.strftime("%Y-%m-%d %H:%M")


def print_keys(keys: list[KeyInfo]) -> None:
    if not keys:
        print("no API keys")
        return
    print_table(
        COLUMNS,
        [
            (
                k.id,
                k.prefix + "…",
                k.org_name,
                k.user_name,
                k.name,
                _when(k.created_at),
                _when(k.last_used_at),
                "revoked" if k.revoked else "active",
            )
            for k in keys
        ],
    )
