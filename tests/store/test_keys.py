"""API keys: shown once, stored only as a hash, authenticate while valid, never listed with secrets."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from sqlalchemy import text

from tokenfleet.quota.limits import Limits
from tokenfleet.store.db import Database
from tokenfleet.store.records import NotFound, Principal
from tokenfleet.store.tenants import TenantStore

pytestmark = pytest.mark.anyio


async def dump(db: Database) -> str:
    """Every value in every table, as text."""
    async with db.engine.connect() as conn:
        rows = []
        for table in ("organisations", "users", "api_keys", "alembic_version"):
            rows += (await conn.execute(text(f"SELECT * FROM {table}"))).all()
    return repr(rows)


async def test_plaintext_is_returned_once_and_only_its_hash_is_stored(store: TenantStore, db: Database):
    info, plaintext = await store.create_key("acme", "alice", "laptop")
    assert plaintext.startswith("tf-") and len(plaintext) == 46
    assert info.id.startswith("key_") and info.prefix == plaintext[:8] and info.name == "laptop"
    stored = await dump(db)
    assert plaintext not in stored and plaintext[3:] not in stored and plaintext[8:] not in stored
    digest = hashlib.sha256(plaintext.encode()).hexdigest()
    async with db.engine.connect() as conn:
        assert (await conn.execute(text("SELECT hash FROM api_keys"))).scalar_one() == digest
    again, second = await store.create_key("acme", "alice", "laptop")
    assert second != plaintext and again.id != info.id and again.user_id == info.user_id


async def test_create_key_makes_org_and_user_with_the_tier(store: TenantStore):
    info, _ = await store.create_key("acme", "alice", tier="paid")
    org = await store.get_org("acme")
    assert org.tier == "paid" and info.org_id == org.id and info.org_name == "acme" and info.user_name == "alice"
    other, _ = await store.create_key(org.id, "bob")  # by id; the existing org keeps its tier
    assert other.org_id == org.id and (await store.get_org("acme")).tier == "paid"
    with pytest.raises(ValueError, match="exists with tier 'paid', not 'free'"):
        await store.create_key("acme", "carol", tier="free")
    with pytest.raises(ValueError, match="unknown tier"):
        await store.create_key("newco", "carol", tier="platinum")


async def test_authenticate(store: TenantStore):
    await store.create_org("acme", tier="enterprise", limits=Limits(tokens_per_minute=9), provisioned_share=0.5)
    await store.create_user("acme", "alice", Limits(concurrent_requests=2))
    info, plaintext = await store.create_key("acme", "alice")
    principal = await store.authenticate(plaintext)
    assert principal == Principal(
        info.id,
        info.org_id,
        "acme",
        info.user_id,
        "alice",
        "enterprise",
        Limits(tokens_per_minute=9),
        Limits(concurrent_requests=2),
        0.5,
    )
    with pytest.raises(AttributeError):
        principal.tier = "free"  # frozen
    assert await store.authenticate(plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")) is None  # unknown
    for malformed in ("", "tf-", plaintext + "x", plaintext[3:], "sk-" + plaintext[3:], None, 42):
        assert await store.authenticate(malformed) is None


async def test_revoked_keys_stop_working(store: TenantStore):
    info, plaintext = await store.create_key("acme", "alice")
    keep, kept = await store.create_key("acme", "alice", "second")
    assert await store.revoke_key(info.id) is True
    assert await store.authenticate(plaintext) is None
    assert (await store.authenticate(kept)).key_id == keep.id  # other keys of the same user still work
    first = {k.id: k for k in await store.list_keys()}[info.id].revoked_at
    assert first is not None and await store.revoke_key(info.id) is True  # again: still revoked, same time
    assert {k.id: k for k in await store.list_keys()}[info.id].revoked_at == first
    assert await store.revoke_key("key_nope") is False


async def test_list_keys_shows_no_secrets(store: TenantStore):
    a, pa = await store.create_key("acme", "alice")
    b, pb = await store.create_key("globex", "bob")
    keys = await store.list_keys()
    assert [k.id for k in keys] == [a.id, b.id] and keys[0] == a
    text_of_listing = repr(keys)
    for plaintext in (pa, pb):
        assert (
            plaintext not in text_of_listing and hashlib.sha256(plaintext.encode()).hexdigest() not in text_of_listing
        )
    assert not any(hasattr(k, "hash") for k in keys)
    assert [k.id for k in await store.list_keys("globex")] == [b.id]
    assert [k.id for k in await store.list_keys(a.org_id)] == [a.id]
    with pytest.raises(NotFound):
        await store.list_keys("nope")


async def test_last_used_is_recorded_coarsely(store: TenantStore):
    info, plaintext = await store.create_key("acme", "alice")
    assert info.last_used_at is None
    await store.authenticate(plaintext)
    first = (await store.list_keys())[0].last_used_at
    assert first is not None and first >= info.created_at - timedelta(seconds=1)
    await store.authenticate(plaintext)  # within the resolution: not written again
    assert (await store.list_keys())[0].last_used_at == first
