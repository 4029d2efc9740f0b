"""Which database a command uses, and creating it (`tokenfleet db init`, `tokenfleet fleet`)."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from tokenfleet.commands.errors import CommandError
from tokenfleet.config import FleetConfig
from tokenfleet.store.db import ENV_VAR, Database, async_url

DATA_HOME = Path("~/.local/share/tokenfleet")
DATABASE_FILE = "tokenfleet.db"
DEFAULT_SERVE_PORT = 8000


def default_data_dir(port: int = DEFAULT_SERVE_PORT) -> Path:
    """`tokenfleet serve`'s folder for one instance, named by its port: two serves on one machine never share a
    database."""
    return DATA_HOME.expanduser() / f"serve-{port}"


def sqlite_url(data_dir: str | Path) -> str:
    return f"sqlite:///{Path(data_dir).expanduser() / DATABASE_FILE}"


def resolve_database_url(
    flag: str | None = None,
    config_path: str | None = None,
    data_dir: str | Path | None = None,
    default_dir: Path | None = None,
) -> str:
    """The --database-url flag, else the SQLite file of a --data-dir given, else $TOKENFLEET_DATABASE_URL, else
    `database_url` in the fleet file, else the SQLite file in `default_dir` (default: the folder of the serve
    instance on port 8000)."""
    if flag:
        return flag
    if data_dir is not None:
        return sqlite_url(data_dir)
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    if config_path:
        url = FleetConfig.load(config_path).database_url
        if url:
            return url
    return sqlite_url(default_dir or default_data_dir())


def add_database_arguments(parser: argparse.ArgumentParser, config_help: str = "its database_url") -> None:
    """--database-url, --config and --data-dir: which database a command uses (resolve_database_url's order)."""
    parser.add_argument(
        "--database-url",
        default=None,
        help="sqlite:///path or postgresql://user@host/db (default: the SQLite file in --data-dir, else "
        "$TOKENFLEET_DATABASE_URL, else database_url in --config, else the default serve instance's)",
    )
    parser.add_argument("--config", default=None, help=f"fleet.yaml: {config_help}")
    add_data_dir_argument(parser)


def add_data_dir_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        default=None,
        help=f"a `tokenfleet serve` instance's folder, whose {DATABASE_FILE} to use (without it, --database-url, "
        f"$TOKENFLEET_DATABASE_URL or --config: {default_data_dir()}, the instance on port {DEFAULT_SERVE_PORT})",
    )


def describe(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


# --- creating a database ----------------------------------------------------------------------------------------


async def create_database(url: str) -> bool:
    """Creates the PostgreSQL database of `url` when it does not exist (through the server's `postgres`
    database); an SQLite file is created on first use anyway. Returns whether it created one."""
    parsed = async_url(url)
    if parsed.get_backend_name() != "postgresql":
        return False
    import asyncpg

    name = parsed.database
    if not name:
        raise CommandError(f"{describe(url)} names no database")
    server = parsed.set(drivername="postgresql", database="postgres").render_as_string(hide_password=False)
    try:
        connection = await asyncpg.connect(server, timeout=5)
    except (OSError, asyncpg.PostgresError) as e:
        raise CommandError(f"cannot reach PostgreSQL for {describe(url)}: {e}") from None
    try:
        if await connection.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            return False
        await connection.execute(f'CREATE DATABASE "{name}"')
        return True
    except asyncpg.DuplicateDatabaseError:  # created by another process meanwhile
        return False
    finally:
        await connection.close()


async def init_database(url: str) -> bool:
    """Creates the database when missing and migrates it to the newest schema. Returns whether it created it."""
    created = await create_database(url)
    async with Database(url) as db:
        await db.migrate()
    return created


def add_db_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="db_action", required=True, metavar="ACTION")
    init = actions.add_parser(
        "init", help="create the database when it does not exist, and migrate it to the newest schema"
    )
    add_database_arguments(init)


def run_db_command(args: argparse.Namespace) -> int:
    url = resolve_database_url(args.database_url, args.config, args.data_dir)
    try:
        created = asyncio.run(init_database(url))
    except (OSError, SQLAlchemyError) as e:
        raise CommandError(f"cannot migrate {describe(url)}: {e}") from None
    print(f"{'created and migrated' if created else 'migrated'} {describe(url)}")
    return 0
