"""Who is calling: `Authorization: Bearer <key>` → the caller's organisation, user, tier and effective limits.

Key look-ups are cached for a few seconds, so a busy gateway asks the database once per key per TTL, not once per
request; a key revoked through this gateway's admin API is dropped from the cache at once, elsewhere within the TTL.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from starlette.requests import Request

from tokenfleet.api.errors import APIError, unauthorized
from tokenfleet.dispatch.tiers import TierConfig
from tokenfleet.quota.base import Scope, scopes_for
from tokenfleet.quota.limits import Limits
from tokenfleet.store.records import Principal


class KeyDirectory(Protocol):
    async def authenticate(self, plaintext: str) -> Principal | None: ...


@dataclass(frozen=True)
class Caller:
    principal: Principal
    tier: TierConfig

    @property
    def tenant(self) -> str:
        return self.principal.org_id

    def scopes(self) -> tuple[Scope, Scope]:
        """The organisation's and the user's quota scopes: tier defaults, overridden per tenant."""
        return self._scopes

    @cached_property
    def _scopes(self) -> tuple[Scope, Scope]:  # once per principal: the Authenticator keeps its Caller
        p = self.principal
        return scopes_for(
            p.org_id,
            p.user_id,
            self.tier.org_limits.override(p.org_limits),
            self.tier.user_limits.override(p.user_limits),
        )


def open_principal(tier: str) -> Principal:
    """The single user of an embedded server started without authentication."""
    return Principal(
        key_id="open",
        org_id="local",
        org_name="local",
        user_id="local",
        user_name="local",
        tier=tier,
        org_limits=Limits(),
        user_limits=Limits(),
        provisioned_share=None,
    )


class Authenticator:
    def __init__(
        self,
        keys: KeyDirectory | None,
        tiers: Mapping[str, TierConfig],
        open_tier: str = "paid",
        cache_ttl_s: float = 5.0,
    ) -> None:
        """keys=None runs open: every request is the embedded server's single user, on `open_tier`."""
        self.keys, self.tiers, self.cache_ttl_s = keys, tiers, cache_ttl_s
        self.open_caller = None if keys is not None else self._caller(open_principal(open_tier))
        self._cache: dict[str, tuple[float, Caller]] = {}  # key digest -> (valid until, its caller)

    async def caller(self, request: Request) -> Caller:
        if self.open_caller is not None:
            return self.open_caller
        plaintext = _bearer(request.headers.get("authorization"))
        digest = hashlib.sha256(plaintext.encode()).hexdigest()
        cached = self._cache.get(digest)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        principal = await self.keys.authenticate(plaintext)
        if principal is None:
            self._cache.pop(digest, None)
            raise unauthorized(
                f"Incorrect API key provided: {_redact(plaintext)}. Create or look up keys with `tokenfleet keys`."
            )
        caller = self._caller(principal)
        self._cache[digest] = (time.monotonic() + self.cache_ttl_s, caller)
        return caller

    def forget_key(self, key_id: str) -> None:
        """A key was revoked here: stop honouring it now rather than when its cache entry expires."""
        for digest in [d for d, (_, c) in self._cache.items() if c.principal.key_id == key_id]:
            del self._cache[digest]

    def _caller(self, principal: Principal) -> Caller:
        tier = self.tiers.get(principal.tier)
        if tier is None:
            raise APIError(
                403,
                f"your organisation's tier {principal.tier!r} is not offered by this gateway",
                "permission_error",
                code="unknown_tier",
            )
        return Caller(principal, tier)


def _bearer(header: str | None) -> str:
    if not header:
        raise unauthorized(
            "You didn't provide an API key. Send it in the Authorization header: `Authorization: Bearer <key>`."
        )
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise unauthorized("Malformed Authorization header: expected `Bearer <key>`.")
    return token


def _redact(key: str) -> str:
    return key[:5] + "*" * 4 + key[-4:] if len(key) > 12 else "*" * len(key)
