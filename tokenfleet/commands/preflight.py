"""Checks before a fleet process starts serving: the services it needs answer. Each failure is a CommandError
whose one line names the service and what to do, instead of a traceback from deep inside a connection pool."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from tokenfleet.commands.database import describe
from tokenfleet.commands.errors import CommandError
from tokenfleet.store.db import async_url

TIMEOUT_S = 5.0


async def check_postgres(url: str, create_hint: str) -> None:
    """The database of a postgresql:// URL exists and takes connections (other databases are not checked)."""
    parsed = async_url(url)
    if parsed.get_backend_name() != "postgresql":
        return
    import asyncpg

    where = f"{parsed.host or 'localhost'}:{parsed.port or 5432}"
    dsn = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        connection = await asyncpg.connect(dsn, timeout=TIMEOUT_S)
    except asyncpg.InvalidCatalogNameError:
        raise CommandError(
            f"the database {parsed.database!r} does not exist on PostgreSQL at {where}: create it with {create_hint}"
        ) from None
    except (OSError, TimeoutError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e.__class__.__name__
        raise CommandError(
            f"cannot reach PostgreSQL at {where} for {describe(url)} ({reason}): is it running?"
        ) from None
    except asyncpg.PostgresError as e:
        raise CommandError(f"PostgreSQL at {where} refused {describe(url)}: {e}") from None
    await connection.close()


async def check_redis(url: str, config_hint: str) -> None:
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    client = aioredis.from_url(url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S)
    try:
        await client.ping()
    except (RedisError, OSError) as e:
        raise CommandError(f"cannot reach Redis at {redis_location(url)} ({e}): start it, or {config_hint}") from None
    finally:
        await client.aclose()


def redis_location(url: str) -> str:
    """host:port/db of a Redis URL, without its password."""
    parts = urlsplit(url)
    return f"{parts.hostname or 'localhost'}:{parts.port or 6379}{parts.path or ''}"


def check_fleet_services(database_url: str | None, redis_url: str | None, config_path: str) -> None:
    """`tokenfleet gateway`: its database and its Redis answer. It creates neither: `tokenfleet db init` does."""

    async def check() -> None:
        if database_url:
            await check_postgres(database_url, f"`tokenfleet db init --config {config_path}`")
        if redis_url:
            await check_redis(redis_url, f"remove redis_url from {config_path} to keep streams and quotas in memory")

    asyncio.run(check())
