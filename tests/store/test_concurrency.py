"""Many callers at once: get-or-create races settle on one org and user; concurrent authentications all succeed."""

from __future__ import annotations

import asyncio

import pytest

from tokenfleet.store.models import Organisation
from tokenfleet.store.records import AlreadyExists
from tokenfleet.store.tenants import TenantStore

pytestmark = pytest.mark.anyio


async def test_concurrent_key_creation_shares_one_org_and_user(store: TenantStore):
    made = await asyncio.gather(*(store.create_key("acme", "alice", f"k{i}") for i in range(8)))
    assert len({info.org_id for info, _ in made}) == 1 and len({info.user_id for info, _ in made}) == 1
    assert len(await store.list_orgs()) == 1 and len(await store.list_keys()) == 8


async def test_concurrent_authentication(store: TenantStore):
    keys = [plaintext for _, plaintext in [await store.create_key("acme", f"u{i}") for i in range(10)]]
    principals = await asyncio.gather(*(store.authenticate(k) for k in keys * 3))
    assert all(p is not None for p in principals)
    assert all(k.last_used_at is not None for k in await store.list_keys())


async def test_a_constraint_hit_inside_a_transaction_is_already_exists(store: TenantStore):
    await store.create_org("acme")
    with pytest.raises(AlreadyExists, match="conflicts with an existing record"):
        async with store.transaction() as session:  # skips the friendly pre-check, as a racing writer would
            session.add(Organisation(id="org_other", name="acme", tier="free"))
