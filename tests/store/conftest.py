"""Every store test runs twice: on an SQLite file and on PostgreSQL, each freshly migrated (the `db` fixture of
tests/conftest.py)."""

from __future__ import annotations

import pytest

from tokenfleet.store.db import Database
from tokenfleet.store.tenants import TenantStore

TIERS = ("free", "paid", "enterprise", "batch")


@pytest.fixture
async def store(db: Database) -> TenantStore:
    return TenantStore(db, tiers=TIERS)
