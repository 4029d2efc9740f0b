"""The admin API over an SQLite store: the admin key guards everything, keys work until revoked, bad bodies are
400s in the OpenAI error shape."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from tokenfleet.gateway.admin import add_admin_routes
from tokenfleet.store.db import Database
from tokenfleet.store.tenants import TenantStore

pytestmark = pytest.mark.anyio
ADMIN_KEY = "admin-secret-123"
AUTH = {"authorization": f"Bearer {ADMIN_KEY}"}
TIERS = ("free", "paid", "enterprise", "batch")


@pytest.fixture
async def store(tmp_path):
    async with Database(f"sqlite:///{tmp_path / 'admin.db'}") as db:
        await db.migrate()
        yield TenantStore(db, TIERS)


def client_for(store: TenantStore, admin_key: str | None = ADMIN_KEY, on_revoke=None) -> httpx.AsyncClient:
    app = FastAPI()
    add_admin_routes(app, store, admin_key, TIERS, on_revoke=on_revoke)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin")


def assert_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"]
    return error


ROUTES = [
    ("POST", "/admin/v1/keys"),
    ("GET", "/admin/v1/keys"),
    ("DELETE", "/admin/v1/keys/key_x"),
    ("POST", "/admin/v1/orgs"),
    ("GET", "/admin/v1/orgs"),
    ("PATCH", "/admin/v1/orgs/acme"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
async def test_admin_key_is_required(store, method, path):
    async with client_for(store) as client:
        assert_error(await client.request(method, path, json={}), 401, "admin key")
        for wrong in ("Bearer nope", f"Basic {ADMIN_KEY}", ADMIN_KEY, f"Bearer {ADMIN_KEY}x", "Bearer ☃".encode()):
            assert_error(await client.request(method, path, json={}, headers={"authorization": wrong}), 401)
    async with client_for(store, admin_key=None) as client:
        error = assert_error(
            await client.request(method, path, json={}, headers=AUTH), 403, "admin API disabled", "TOKENFLEET_ADMIN_KEY"
        )
        assert error["code"] == "admin_disabled"


async def test_key_lifecycle(store):
    revoked_ids = []
    async with client_for(store, on_revoke=revoked_ids.append) as client:
        created = await client.post(
            "/admin/v1/keys", json={"org": "acme", "user": "alice", "tier": "paid"}, headers=AUTH
        )
        assert created.status_code == 201 and created.headers["cache-control"] == "no-store"
        body = created.json()
        plaintext = body["key"]
        assert body["id"].startswith("key_") and body["prefix"] == plaintext[:8] and body["name"] == "default"
        principal = await store.authenticate(plaintext)
        assert principal.org_name == "acme" and principal.user_name == "alice" and principal.tier == "paid"

        listed = (await client.get("/admin/v1/keys", params={"org": "acme"}, headers=AUTH)).json()
        assert [k["id"] for k in listed["data"]] == [body["id"]] and listed["object"] == "list"
        assert plaintext not in str(listed) and "hash" not in listed["data"][0] and "key" not in listed["data"][0]
        assert (await client.get("/admin/v1/keys", headers=AUTH)).json()["data"][0]["revoked_at"] is None

        revoked = await client.delete(f"/admin/v1/keys/{body['id']}", headers=AUTH)
        assert revoked.status_code == 200 and revoked.json()["revoked"] is True
        assert revoked_ids == [body["id"]]  # e.g. the gateway's key cache forgets it at once
        assert await store.authenticate(plaintext) is None
        assert (await client.get("/admin/v1/keys", headers=AUTH)).json()["data"][0]["revoked_at"] is not None
        assert_error(await client.delete("/admin/v1/keys/key_unknown", headers=AUTH), 404, "key_unknown")
        assert revoked_ids == [body["id"]]
        assert_error(await client.get("/admin/v1/keys", params={"org": "nope"}, headers=AUTH), 404, "nope")


async def test_org_lifecycle(store):
    async with client_for(store) as client:
        created = await client.post(
            "/admin/v1/orgs",
            headers=AUTH,
            json={
                "name": "Acme",
                "id": "acme",
                "tier": "enterprise",
                "limits": {"tokens_per_minute": 5000},
                "provisioned_share": 0.3,
            },
        )
        assert created.status_code == 201, created.text
        org = created.json()
        assert org["id"] == "acme" and org["tier"] == "enterprise" and org["provisioned_share"] == 0.3
        assert org["limits"] == {
            "requests_per_minute": None,
            "tokens_per_minute": 5000,
            "concurrent_requests": None,
            "tokens_per_day": None,
        }
        patched = await client.patch(
            "/admin/v1/orgs/acme", headers=AUTH, json={"tier": "paid", "limits": {"requests_per_minute": 60}}
        )
        assert patched.status_code == 200, patched.text
        assert patched.json()["tier"] == "paid" and patched.json()["provisioned_share"] == 0.3
        assert patched.json()["limits"]["requests_per_minute"] == 60  # merged: the others stay
        assert patched.json()["limits"]["tokens_per_minute"] == 5000
        cleared = (
            await client.patch(
                "/admin/v1/orgs/Acme",
                headers=AUTH,
                json={"limits": {"tokens_per_minute": None}, "provisioned_share": None},
            )
        ).json()
        assert cleared["limits"]["tokens_per_minute"] is None and cleared["provisioned_share"] is None
        listed = (await client.get("/admin/v1/orgs", headers=AUTH)).json()["data"]
        assert [o["id"] for o in listed] == ["acme"] and listed[0] == cleared
        assert (await client.get("/admin/v1/orgs/acme", headers=AUTH)).json() == cleared
        assert (await store.get_org("acme")).tier == "paid"
        assert_error(await client.post("/admin/v1/orgs", headers=AUTH, json={"name": "Acme"}), 409, "Acme")
        assert_error(await client.patch("/admin/v1/orgs/nope", headers=AUTH, json={"tier": "paid"}), 404, "nope")
        assert_error(await client.patch("/admin/v1/orgs/nope", headers=AUTH, json={"limits": {}}), 404, "nope")


BAD_BODIES = [
    ("POST", "/admin/v1/keys", b"{not json", "not valid JSON"),
    ("POST", "/admin/v1/keys", b"", "not valid JSON"),
    ("POST", "/admin/v1/keys", [1, 2], "JSON object"),
    ("POST", "/admin/v1/keys", {"user": "alice"}, "org"),
    ("POST", "/admin/v1/keys", {"org": "acme", "user": 7}, "user"),
    ("POST", "/admin/v1/keys", {"org": "acme", "user": ""}, "user name must be a non-empty string"),
    ("POST", "/admin/v1/keys", {"org": "acme", "user": "a", "tier": "gold"}, "unknown tier 'gold'"),
    ("POST", "/admin/v1/keys", {"org": "acme", "user": "a", "colour": "red"}, "colour"),
    ("POST", "/admin/v1/orgs", {"name": "x", "limits": {"tokens_per_minute": -5}}, "tokens_per_minute"),
    ("POST", "/admin/v1/orgs", {"name": "x", "limits": {"tokens_per_minute": "5"}}, "whole number"),
    ("POST", "/admin/v1/orgs", {"name": "x", "limits": {"tpm": 5}}, "unknown limit"),
    ("POST", "/admin/v1/orgs", {"name": "x", "limits": [5]}, "limits"),
    ("POST", "/admin/v1/orgs", {"name": "x", "provisioned_share": 2}, "provisioned_share"),
    ("POST", "/admin/v1/orgs", {"name": "x", "provisioned_share": "0.5"}, "provisioned_share"),
    ("POST", "/admin/v1/orgs", {"name": "x", "id": "Not A Slug"}, "organisation id"),
    ("PATCH", "/admin/v1/orgs/acme", {"tier": None}, "tier"),
    ("PATCH", "/admin/v1/orgs/acme", {"tier": "gold"}, "unknown tier"),
    ("PATCH", "/admin/v1/orgs/acme", {"limits": {"concurrent_requests": 1.5}}, "concurrent_requests"),
    ("PATCH", "/admin/v1/orgs/acme", {"provisioned_share": -0.1}, "provisioned_share"),
    ("PATCH", "/admin/v1/orgs/acme", {"name": "renamed"}, "name"),
]


@pytest.mark.parametrize(("method", "path", "body", "words"), BAD_BODIES)
async def test_bad_bodies_are_400s(store, method, path, body, words):
    await store.create_org("acme", tier="free")
    async with client_for(store) as client:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        error = assert_error(await client.request(method, path, headers=AUTH, **kwargs), 400, words)
        assert error["type"] == "invalid_request_error"
    assert [o.name for o in await store.list_orgs()] == ["acme"] and await store.list_keys() == []
