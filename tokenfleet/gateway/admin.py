"""The admin API under /admin/v1: organisations and API keys, and the fleet view the operator console polls, for
operators holding the admin key.

Every route needs `Authorization: Bearer <admin_key>`; without a configured admin key they all answer 403. Errors
use the OpenAI error shape; a key's plaintext appears in exactly one response, the one that creates it."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tokenfleet.api.errors import APIError, bad_request, not_found
from tokenfleet.api.http import install_error_handler, read_json
from tokenfleet.api.protocol import parse
from tokenfleet.gateway.fleet_view import fleet_view
from tokenfleet.gateway.gateway import Gateway
from tokenfleet.quota.limits import Limits
from tokenfleet.store.records import AlreadyExists, KeyInfo, NotFound, OrgInfo
from tokenfleet.store.tenants import KEEP, TenantStore
from tokenfleet.store.validation import check_tier

PREFIX = "/admin/v1"
DISABLED = "admin API disabled: set admin_key / TOKENFLEET_ADMIN_KEY"


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    org: str
    user: str
    name: str = "default"
    tier: str | None = None  # for an organisation created by this call; default free


class NewOrg(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    id: str | None = None
    tier: str = "free"
    limits: dict | None = None
    provisioned_share: object = None  # checked by the store: a number from 0 to 1 or null


class OrgChanges(BaseModel):
    """A merge patch: only the fields sent change; in `limits`, only the limits named, and null clears one."""

    model_config = ConfigDict(extra="forbid", strict=True)
    tier: str | None = None
    limits: dict | None = None
    provisioned_share: object = None


def _unix(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def key_json(info: KeyInfo) -> dict:
    return {
        "object": "api_key",
        "id": info.id,
        "name": info.name,
        "prefix": info.prefix,
        "org_id": info.org_id,
        "org": info.org_name,
        "user_id": info.user_id,
        "user": info.user_name,
        "created_at": _unix(info.created_at),
        "revoked_at": _unix(info.revoked_at),
        "last_used_at": _unix(info.last_used_at),
    }


def org_json(info: OrgInfo) -> dict:
    return {
        "object": "organisation",
        "id": info.id,
        "name": info.name,
        "tier": info.tier,
        "limits": asdict(info.limits),
        "provisioned_share": info.provisioned_share,
        "created_at": _unix(info.created_at),
    }


@contextmanager
def store_errors() -> Iterator[None]:
    """The store's exceptions as API errors: a taken name 409, an unknown one 404, any other bad value 400."""
    try:
        yield
    except AlreadyExists as e:
        raise APIError(409, str(e), code="already_exists") from None
    except NotFound as e:
        raise not_found(str(e)) from None
    except ValueError as e:
        raise bad_request(str(e)) from None


def admin_guard(admin_key: str | None):
    async def guard(request: Request) -> None:
        if not admin_key:
            raise APIError(403, DISABLED, "permission_error", code="admin_disabled")
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), admin_key.encode()):
            raise APIError(
                401, "missing or wrong admin key: send Authorization: Bearer <admin_key>", code="invalid_admin_key"
            )

    return guard


def add_fleet_view(app: FastAPI, gateway: Gateway, admin_key: str | None) -> None:
    """GET /admin/v1/fleet: models, replicas, the overload ladder, queues and refusals per tier, the autoscaler's
    decision (tokenfleet.gateway.fleet_view), read from memory."""
    router = APIRouter(prefix=PREFIX, dependencies=[Depends(admin_guard(admin_key))])

    @router.get("/fleet")
    async def fleet() -> JSONResponse:
        return JSONResponse({"object": "fleet", **asdict(fleet_view(gateway))}, headers={"cache-control": "no-store"})

    app.include_router(router)


def add_admin_routes(
    app: FastAPI,
    store: TenantStore,
    admin_key: str | None,
    tiers: Collection[str],
    on_revoke: Callable[[str], None] | None = None,
) -> None:
    """`on_revoke(key_id)` runs after a key is revoked, e.g. to drop it from an authentication cache at once."""
    router = APIRouter(prefix=PREFIX, dependencies=[Depends(admin_guard(admin_key))])
    _key_routes(router, store, tiers, on_revoke)
    _org_routes(router, store, tiers)
    install_error_handler(app)
    app.include_router(router)


def _key_routes(
    router: APIRouter, store: TenantStore, tiers: Collection[str], on_revoke: Callable[[str], None] | None
) -> None:
    @router.post("/keys", status_code=201)
    async def create_key(request: Request) -> JSONResponse:
        body = parse(NewKey, await read_json(request))
        with store_errors():
            tier = None if body.tier is None else check_tier(body.tier, tiers)
            info, plaintext = await store.create_key(body.org, body.user, body.name, tier)
        # The only time the key is ever shown; keep it out of caches.
        return JSONResponse(
            {**key_json(info), "key": plaintext}, status_code=201, headers={"cache-control": "no-store"}
        )

    @router.get("/keys")
    async def list_keys(org: str | None = None) -> dict:
        with store_errors():
            keys = await store.list_keys(org)
        return {"object": "list", "data": [key_json(key) for key in keys]}

    @router.delete("/keys/{key_id}")
    async def revoke_key(key_id: str) -> dict:
        if not await store.revoke_key(key_id):
            raise not_found(f"no API key with id {key_id!r}", param="key_id", code="key_not_found")
        if on_revoke is not None:
            on_revoke(key_id)
        return {"object": "api_key", "id": key_id, "revoked": True}


def _org_routes(router: APIRouter, store: TenantStore, tiers: Collection[str]) -> None:
    @router.post("/orgs", status_code=201)
    async def create_org(request: Request) -> JSONResponse:
        body = parse(NewOrg, await read_json(request))
        with store_errors():
            org = await store.create_org(
                body.name,
                check_tier(body.tier, tiers),
                Limits.from_dict(body.limits, "limits"),
                body.provisioned_share,
                org_id=body.id,
            )
        return JSONResponse(org_json(org), status_code=201)

    @router.get("/orgs")
    async def list_orgs() -> dict:
        return {"object": "list", "data": [org_json(org) for org in await store.list_orgs()]}

    @router.get("/orgs/{org_id}")
    async def get_org(org_id: str) -> dict:
        org = await store.get_org(org_id)
        if org is None:
            raise not_found(f"no organisation with id or name {org_id!r}", param="org_id", code="org_not_found")
        return org_json(org)

    @router.patch("/orgs/{org_id}")
    async def update_org(org_id: str, request: Request) -> dict:
        changes = parse(OrgChanges, await read_json(request))
        with store_errors():
            return org_json(await apply_changes(store, org_id, changes, tiers))


async def apply_changes(store: TenantStore, org_id: str, changes: OrgChanges, tiers: Collection[str]) -> OrgInfo:
    sent = changes.model_fields_set
    if "tier" in sent and changes.tier is None:
        raise ValueError("tier cannot be null")
    tier = None if changes.tier is None else check_tier(changes.tier, tiers)
    limits = None
    if "limits" in sent:  # merged into the current overrides; "limits": null clears them all
        current = await store.get_org(org_id)
        if current is None:
            raise NotFound(f"no organisation with id or name {org_id!r}")
        merged = {} if changes.limits is None else {**asdict(current.limits), **changes.limits}
        limits = Limits.from_dict(merged, "limits")
    share = changes.provisioned_share if "provisioned_share" in sent else KEEP
    return await store.update_org(org_id, tier, limits, share)
