"""The databases the store suite runs against: an SQLite file, and a throwaway database on the local PostgreSQL
(TOKENFLEET_TEST_POSTGRES, default postgresql://postgres@127.0.0.1:5432/postgres) that is dropped afterwards."""

from __future__ import annotations

import asyncio
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import asyncpg

POSTGRES_ADMIN_URL = os.environ.get("TOKENFLEET_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")


def blocking(coro):
    """Runs a coroutine to completion on its own loop in another thread, so sync fixtures can use asyncpg without
    touching the test's event loop."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def database_url(name: str) -> str:
    return POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + "/" + name


async def _admin(sql: str) -> None:
    conn = await asyncpg.connect(POSTGRES_ADMIN_URL, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def create_postgres_database() -> str:
    name = f"tftest_{uuid.uuid4().hex}"
    blocking(_admin(f'CREATE DATABASE "{name}"'))
    return name


def drop_postgres_database(name: str) -> None:
    blocking(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


async def _reset(url: str) -> None:
    conn = await asyncpg.connect(url, timeout=5)
    try:
        await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    finally:
        await conn.close()


def reset_postgres_database(url: str) -> None:
    """Empties the database (tables and Alembic's version record), so each test migrates from nothing."""
    blocking(_reset(url))
