"""Shared fixtures: a tiny demo checkpoint (byte-level BPE tokenizer + random Llama weights), written once, and the
SQL databases (SQLite and PostgreSQL) the store and metering suites run on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.store.backends import (
    POSTGRES_ADMIN_URL,
    create_postgres_database,
    database_url,
    drop_postgres_database,
    reset_postgres_database,
)
from tokenfleet.model.demo import write_demo_checkpoint
from tokenfleet.store.db import Database


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete HF-format "tiny" Llama checkpoint folder (seed 0). Treat it as read-only; copy it to modify."""
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo-model") / "tiny", size="tiny", seed=0)


# --- SQL: every database test runs on an SQLite file and on a throwaway PostgreSQL database --------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def postgres_url():
    """One PostgreSQL database for the session (the local server; see tests/store/backends.py), dropped after."""
    try:
        name = create_postgres_database()
    except OSError as e:
        pytest.fail(f"no PostgreSQL at {POSTGRES_ADMIN_URL} ({e}); .ci/run starts it, or set TOKENFLEET_TEST_POSTGRES")
    yield database_url(name)
    drop_postgres_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """An empty database of each kind in turn."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'test.db'}"
    url = request.getfixturevalue("postgres_url")
    reset_postgres_database(url)
    return url


@pytest.fixture
async def db(db_url: str):
    """That database, migrated to head."""
    async with Database(db_url) as database:
        await database.migrate()
        yield database
