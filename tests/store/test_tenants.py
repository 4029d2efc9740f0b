"""Organisations and users: creation, lookups by id or name, limit overrides, tiers, and clear errors."""

from __future__ import annotations

import pytest

from tokenfleet.quota.limits import Limits
from tokenfleet.store.records import AlreadyExists, NotFound
from tokenfleet.store.tenants import TenantStore

pytestmark = pytest.mark.anyio


async def test_org_round_trip_by_id_and_name(store: TenantStore):
    limits = Limits(requests_per_minute=100, tokens_per_day=10**12)  # the largest limit fits (BIGINT)
    org = await store.create_org("Acme Corp", tier="paid", limits=limits, provisioned_share=0.25)
    assert org.id.startswith("org_") and org.created_at.tzinfo is not None
    assert await store.get_org(org.id) == await store.get_org("Acme Corp") == org
    assert org.limits == limits and org.provisioned_share == 0.25 and org.tier == "paid"
    assert await store.get_org("nobody") is None
    slug = await store.create_org("Beta", org_id="beta-labs")
    assert slug.id == "beta-labs" and slug.tier == "free" and slug.limits == Limits()
    assert [o.name for o in await store.list_orgs()] == ["Acme Corp", "Beta"]


async def test_org_updates(store: TenantStore):
    org = await store.create_org("acme", limits=Limits(tokens_per_minute=5))
    assert (await store.set_org_tier("acme", "enterprise")).tier == "enterprise"
    changed = await store.set_org_limits(org.id, Limits(concurrent_requests=3))
    assert changed.limits == Limits(concurrent_requests=3)  # replaces all four overrides
    assert (await store.set_provisioned_share("acme", 1)).provisioned_share == 1.0
    both = await store.update_org("acme", tier="batch", provisioned_share=None)
    assert both.tier == "batch" and both.provisioned_share is None and both.limits == changed.limits
    assert await store.get_org(org.id) == both
    with pytest.raises(NotFound, match="nope"):
        await store.set_org_tier("nope", "paid")


async def test_user_limits_round_trip(store: TenantStore):
    await store.create_org("acme")
    user = await store.create_user("acme", "alice", Limits(tokens_per_minute=1000, concurrent_requests=0))
    assert user.id.startswith("user_") and user.limits == Limits(tokens_per_minute=1000, concurrent_requests=0)
    assert await store.get_user("acme", "alice") == user
    updated = await store.set_user_limits("acme", "alice", Limits(requests_per_minute=7))
    assert updated.limits == Limits(requests_per_minute=7)
    assert await store.get_user("acme", "bob") is None and await store.get_user("nope", "alice") is None
    with pytest.raises(NotFound, match="no organisation"):
        await store.create_user("nope", "alice")


async def test_unique_names_give_clear_errors(store: TenantStore):
    org = await store.create_org("acme")
    with pytest.raises(AlreadyExists, match="'acme' already exists"):
        await store.create_org("acme", tier="paid")
    with pytest.raises(AlreadyExists, match="already exists"):
        await store.create_org("other", org_id=org.id)  # an id is taken like a name is
    await store.create_user("acme", "alice")
    with pytest.raises(AlreadyExists, match="already has a user named 'alice'"):
        await store.create_user(org.id, "alice")
    await store.create_org("globex")
    await store.create_user("globex", "alice")  # the same user name in another organisation is fine


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.create_org(""), "organisation name must be a non-empty string"),
        (lambda s: s.create_org("   "), "organisation name must be a non-empty string"),
        (lambda s: s.create_org("x" * 201), "longer than 200"),
        (lambda s: s.create_org("a\nb"), "control characters"),
        (lambda s: s.create_org("acme", tier="gold"), "unknown tier 'gold'; known: batch, enterprise, free, paid"),
        (lambda s: s.create_org("acme", provisioned_share=1.5), "provisioned_share must be a number from 0 to 1"),
        (lambda s: s.create_org("acme", provisioned_share=float("nan")), "provisioned_share"),
        (lambda s: s.create_org("acme", org_id="Has Spaces"), "organisation id must be"),
        (lambda s: s.create_org("acme", limits={"tokens_per_minute": -1}), "tokens_per_minute must be between"),
        (lambda s: s.create_org("acme", limits={"tpm": 5}), "unknown limit"),
        (lambda s: s.create_key("acme", "", "k"), "user name must be a non-empty string"),
    ],
)
async def test_bad_input_is_a_value_error(store: TenantStore, call, message):
    with pytest.raises(ValueError, match=message):
        await call(store)
    assert await store.list_orgs() == []  # nothing half-created


async def test_tiers_are_free_form_without_a_tier_list(db):
    store = TenantStore(db)
    assert (await store.create_org("acme", tier="gold")).tier == "gold"
