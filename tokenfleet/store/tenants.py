"""TenantStore: organisations, users and API keys, and turning a presented key into the Principal it speaks for."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from datetime import timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from tokenfleet.quota.limits import Limits
from tokenfleet.store.api_keys import key_hash, new_id, new_key, shown_prefix, well_formed
from tokenfleet.store.db import Database
from tokenfleet.store.models import ApiKey, Organisation, User, utcnow
from tokenfleet.store.records import AlreadyExists, KeyInfo, NotFound, OrgInfo, Principal, UserInfo
from tokenfleet.store.validation import check_limits, check_name, check_share, check_slug, check_tier

log = logging.getLogger(__name__)
DEFAULT_TIER = "free"
LAST_USED_RESOLUTION = timedelta(seconds=60)  # last_used_at is written at most this often per key
KEEP = object()  # update_org: leave this field as it is


def org_info(org: Organisation) -> OrgInfo:
    return OrgInfo(org.id, org.name, org.tier, org.limits(), org.provisioned_share, org.created_at)


def user_info(user: User) -> UserInfo:
    return UserInfo(user.id, user.org_id, user.name, user.limits(), user.created_at)


def key_info(key: ApiKey, org: Organisation, user: User) -> KeyInfo:
    return KeyInfo(
        key.id,
        org.id,
        org.name,
        user.id,
        user.name,
        key.name,
        key.prefix,
        key.created_at,
        key.revoked_at,
        key.last_used_at,
    )


async def find_org(session: AsyncSession, ref: str) -> Organisation | None:
    """By id, else by name."""
    org = await session.get(Organisation, ref)
    if org is None:
        org = await session.scalar(select(Organisation).where(Organisation.name == ref))
    return org


def keys_with_owners():
    return (
        select(ApiKey, Organisation, User)
        .join(Organisation, ApiKey.org_id == Organisation.id)
        .join(User, ApiKey.user_id == User.id)
    )


async def find_user(session: AsyncSession, org: Organisation, name: str) -> User | None:
    return await session.scalar(select(User).where(User.org_id == org.id, User.name == name))


class TenantStore:
    """`tiers`: the tier names that exist (from fleet.yaml); when given, other tier names are refused."""

    def __init__(self, db: Database, tiers: Collection[str] | None = None) -> None:
        self.db, self.tiers = db, tiers

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncSession]:
        """One committed unit of work; a unique constraint hit by a concurrent writer becomes AlreadyExists."""
        try:
            async with self.db.sessions.begin() as session:
                yield session
        except IntegrityError as e:
            raise AlreadyExists(f"conflicts with an existing record: {e.orig}") from None

    async def _org(self, session: AsyncSession, ref: str) -> Organisation:
        org = await find_org(session, check_name(ref, "organisation"))
        if org is None:
            raise NotFound(f"no organisation with id or name {ref!r}")
        return org

    # --- organisations ----------------------------------------------------------------------------------------

    async def create_org(
        self,
        name: str,
        tier: str = DEFAULT_TIER,
        limits: Limits | None = None,
        provisioned_share: float | None = None,
        org_id: str | None = None,
    ) -> OrgInfo:
        """`org_id`: a slug of your choosing (a-z, 0-9, - and _), else one like org_3f9a1c0b2d4e6f70 is made."""
        async with self.transaction() as session:
            org = await self._add_org(session, name, tier, limits, provisioned_share, org_id)
            return org_info(org)

    async def _add_org(
        self,
        session: AsyncSession,
        name: str,
        tier: str,
        limits: Limits | None,
        share: float | None,
        org_id: str | None,
    ) -> Organisation:
        name, tier = check_name(name, "organisation name"), check_tier(tier, self.tiers)
        limits, share = check_limits(limits), check_share(share)
        org_id = new_id("org") if org_id is None else check_slug(org_id)
        # Names and ids share one namespace for lookups, so neither may equal an existing name or id.
        for ref in (name, org_id):
            if await find_org(session, ref) is not None:
                raise AlreadyExists(f"an organisation with name or id {ref!r} already exists")
        org = Organisation(id=org_id, name=name, tier=tier, provisioned_share=share)
        org.set_limits(limits)
        session.add(org)
        await session.flush()
        return org

    async def get_org(self, org: str) -> OrgInfo | None:
        async with self.transaction() as session:
            found = await find_org(session, org)
            return org_info(found) if found else None

    async def list_orgs(self) -> list[OrgInfo]:
        async with self.transaction() as session:
            orgs = await session.scalars(select(Organisation).order_by(Organisation.created_at, Organisation.id))
            return [org_info(org) for org in orgs]

    async def update_org(
        self, org: str, tier: str | None = None, limits: Limits | None = None, provisioned_share: object = KEEP
    ) -> OrgInfo:
        """Changes what is given, in one transaction: `limits` replaces all four overrides (Limits() clears
        them); `provisioned_share=None` clears it. Raises NotFound for an unknown organisation."""
        tier = None if tier is None else check_tier(tier, self.tiers)
        limits = None if limits is None else check_limits(limits)
        share = KEEP if provisioned_share is KEEP else check_share(provisioned_share)
        async with self.transaction() as session:
            found = await self._org(session, org)
            if tier is not None:
                found.tier = tier
            if limits is not None:
                found.set_limits(limits)
            if share is not KEEP:
                found.provisioned_share = share
            return org_info(found)

    async def set_org_limits(self, org: str, limits: Limits) -> OrgInfo:
        return await self.update_org(org, limits=check_limits(limits))  # None clears the overrides

    async def set_org_tier(self, org: str, tier: str) -> OrgInfo:
        return await self.update_org(org, tier=check_tier(tier, self.tiers))

    async def set_provisioned_share(self, org: str, share: float | None) -> OrgInfo:
        return await self.update_org(org, provisioned_share=share)

    # --- users ------------------------------------------------------------------------------------------------

    async def create_user(self, org: str, name: str, limits: Limits | None = None) -> UserInfo:
        """Raises NotFound for an unknown organisation, AlreadyExists when the name is taken in it."""
        name, limits = check_name(name, "user name"), check_limits(limits)
        async with self.transaction() as session:
            found = await self._org(session, org)
            if await find_user(session, found, name) is not None:
                raise AlreadyExists(f"organisation {found.name!r} already has a user named {name!r}")
            return user_info(await self._add_user(session, found, name, limits))

    async def _add_user(self, session: AsyncSession, org: Organisation, name: str, limits: Limits) -> User:
        user = User(id=new_id("user"), org_id=org.id, name=name)
        user.set_limits(limits)
        session.add(user)
        await session.flush()
        return user

    async def get_user(self, org: str, name: str) -> UserInfo | None:
        async with self.transaction() as session:
            found = await find_org(session, org)
            user = found and await find_user(session, found, name)
            return user_info(user) if user else None

    async def set_user_limits(self, org: str, name: str, limits: Limits) -> UserInfo:
        limits = check_limits(limits)
        async with self.transaction() as session:
            found = await self._org(session, org)
            user = await find_user(session, found, name)
            if user is None:
                raise NotFound(f"organisation {found.name!r} has no user named {name!r}")
            user.set_limits(limits)
            return user_info(user)

    # --- API keys ---------------------------------------------------------------------------------------------

    async def create_key(
        self, org: str, user: str, key_name: str = "default", tier: str | None = None
    ) -> tuple[KeyInfo, str]:
        """A new key for `user` of `org` (both created when missing; a new org gets `tier`, default free).
        Returns the key's record and its plaintext, which exists only in this return value."""
        org, user = check_name(org, "organisation"), check_name(user, "user name")
        key_name = check_name(key_name, "key name")
        tier = None if tier is None else check_tier(tier, self.tiers)
        for attempt in range(2):  # a concurrent creator of the same org or user wins once; then we find theirs
            try:
                async with self.transaction() as session:
                    return await self._add_key(session, org, user, key_name, tier)
            except AlreadyExists:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _add_key(
        self, session: AsyncSession, org_ref: str, user_name: str, key_name: str, tier: str | None
    ) -> tuple[KeyInfo, str]:
        org = await find_org(session, org_ref)
        if org is None:
            org = await self._add_org(session, org_ref, tier or DEFAULT_TIER, None, None, None)
        elif tier is not None and tier != org.tier:
            raise ValueError(
                f"organisation {org.name!r} exists with tier {org.tier!r}, not {tier!r}; change its "
                "tier explicitly (PATCH /admin/v1/orgs/{id}) or leave the tier out"
            )
        user = await find_user(session, org, user_name) or await self._add_user(session, org, user_name, Limits())
        plaintext = new_key()
        key = ApiKey(
            id=new_id("key"),
            org_id=org.id,
            user_id=user.id,
            name=key_name,
            prefix=shown_prefix(plaintext),
            hash=key_hash(plaintext),
        )
        session.add(key)
        await session.flush()
        return key_info(key, org, user), plaintext

    async def list_keys(self, org: str | None = None) -> list[KeyInfo]:
        """All keys (revoked ones too), oldest first; of one organisation when `org` is given (NotFound if
        unknown)."""
        async with self.transaction() as session:
            query = keys_with_owners().order_by(ApiKey.created_at, ApiKey.id)
            if org is not None:
                query = query.where(ApiKey.org_id == (await self._org(session, org)).id)
            return [key_info(key, o, u) for key, o, u in await session.execute(query)]

    async def revoke_key(self, key_id: str) -> bool:
        """True when the key exists (now revoked; an earlier revocation time is kept), False when unknown."""
        async with self.transaction() as session:
            key = await session.get(ApiKey, key_id)
            if key is None:
                return False
            key.revoked_at = key.revoked_at or utcnow()
            return True

    async def authenticate(self, plaintext: str) -> Principal | None:
        """The Principal of a valid key; None for a malformed, unknown or revoked one. Looking up by hash leaks
        nothing useful through timing: the hash of an unknown 256-bit secret is not guessable."""
        if not well_formed(plaintext):
            return None
        async with self.transaction() as session:
            query = keys_with_owners().where(ApiKey.hash == key_hash(plaintext))
            row = (await session.execute(query)).one_or_none()
        if row is None or row[0].revoked_at is not None:
            return None
        key, org, user = row
        if key.last_used_at is None or utcnow() - key.last_used_at >= LAST_USED_RESOLUTION:
            await self._touch(key.id)
        return Principal(
            key.id, org.id, org.name, user.id, user.name, org.tier, org.limits(), user.limits(), org.provisioned_share
        )

    async def _touch(self, key_id: str) -> None:
        """Records last_used_at, best effort: a busy database must not turn a valid key into a failed request."""
        now = utcnow()
        stale = or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at <= now - LAST_USED_RESOLUTION)
        try:
            async with self.transaction() as session:
                await session.execute(update(ApiKey).where(ApiKey.id == key_id, stale).values(last_used_at=now))
        except DBAPIError as e:
            log.warning("could not record last use of %s: %s", key_id, e)
