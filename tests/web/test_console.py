"""The operator console in Chromium against `tokenfleet serve --auth`: it wants the admin key; it shows the models,
the replica and its health, the queues per tier and usage with cost by organisation; drain from the page; an API
key created there is shown once, works in the chat page, and once revoked signs that page out."""

from __future__ import annotations

import re
import uuid

import httpx

from tests.web.conftest import ADMIN_KEY, reply_text, send, set_options, sign_in, wait_status, wait_until


def console(context, base: str, admin_key: str = ADMIN_KEY):
    page = context.new_page()
    page.goto(f"{base}/console")
    page.get_by_label("Admin key").fill(admin_key)
    page.get_by_role("button", name="Sign in").click()
    return page


def test_the_console_wants_the_admin_key(site, context):
    page = console(context, site.base, "not-the-admin-key")
    page.get_by_text("That admin key was not accepted.").wait_for()
    assert page.locator("#app").is_hidden()


def test_the_console_shows_replicas_queues_and_usage_by_organisation(site, context):
    org = f"console-{uuid.uuid4().hex[:6]}"
    key = site.new_key(org=org)
    response = httpx.post(
        f"{site.base}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    wait_until(lambda: org_in_usage(site, org), 15, "the request in the usage warehouse")

    page = console(context, site.base)
    row = page.locator("tr[data-replica='local']")
    row.wait_for()
    assert row.get_attribute("data-healthy") == "true"
    assert row.get_by_text("healthy", exact=True).is_visible() and row.get_by_text("closed").is_visible()
    assert page.get_by_text("Level 0").is_visible()
    assert page.locator("#models h3").first.text_content() == "tiny"
    tiers = page.locator("#queues tr[data-tier]")
    assert {tiers.nth(i).get_attribute("data-tier") for i in range(tiers.count())} >= {"paid", "free", "batch"}
    usage = page.locator("#usage")
    usage.get_by_role("cell", name=org).wait_for()
    cost = usage.get_by_role("row", name=re.compile(org)).get_by_role("cell").last.text_content()
    assert re.fullmatch(r"\$0\.\d+", cost) and float(cost[1:]) > 0, cost  # priced: 4 USD per million output tokens
    assert usage.get_by_role("img", name=re.compile("Cost per day by organisation")).is_visible()

    row.get_by_role("button", name="Drain local").click()
    row.get_by_text("draining", exact=True).wait_for()
    assert [r["draining"] for r in fleet_replicas(site)] == [True]
    row.get_by_role("button", name="Undrain local").click()
    wait_until(lambda: [r["draining"] for r in fleet_replicas(site)] == [False], 10, "the replica back in rotation")


def test_a_key_created_in_the_console_is_shown_once_works_in_chat_and_revoking_signs_out(site, browser, context):
    name = f"laptop-{uuid.uuid4().hex[:6]}"
    page = console(context, site.base)
    page.get_by_role("textbox", name="Organisation", exact=True).fill(f"web-{uuid.uuid4().hex[:6]}")
    page.get_by_role("textbox", name="User", exact=True).fill("zoe")
    page.get_by_role("textbox", name="Key name").fill(name)
    page.get_by_role("button", name="Create key").click()
    shown = page.locator("#created-key-value")
    shown.wait_for()
    key = shown.text_content()
    assert key.startswith("tf-") and len(key) > 20
    listed = page.locator("#keys tr", has_text=name)
    listed.wait_for()
    assert key not in listed.text_content()  # the list shows the prefix only
    page.get_by_role("button", name="Done").click()
    assert shown.is_hidden() and key not in page.content()
    page.reload()
    page.locator("#keys tr", has_text=name).wait_for()
    assert key not in page.content()  # never shown again

    chat_context = browser.new_context()
    try:
        chat = chat_context.new_page()
        sign_in(chat, site.base, key)
        set_options(chat, {"max_tokens": 4, "temperature": 0})
        send(chat, "Hello")
        wait_status(chat, "complete")
        assert reply_text(chat)

        page.get_by_label("Filter by name").fill(name)
        page.get_by_role("button", name=re.compile(f"^Revoke {name}")).click()
        page.get_by_role("button", name="Confirm revoke").click()
        wait_until(
            lambda: page.locator("#keys tr", has_text=name).count() == 0, 10, "the revoked key to leave the list"
        )
        page.get_by_label("Show revoked").check()
        page.locator("#keys tr", has_text=name).get_by_text("revoked").wait_for()

        send(chat, "Still there?")
        chat.locator("#sign-in-message", has_text="Your API key was not accepted").wait_for()
        assert chat.get_by_label("API key").is_visible() and chat.get_by_label("Message").is_hidden()
    finally:
        chat_context.close()


def org_in_usage(site, org: str) -> bool:
    lines = site.admin("GET", "/usage", params={"group_by": "org"}).json()["data"]
    orgs = {o["id"]: o["name"] for o in site.admin("GET", "/orgs").json()["data"]}
    return any(orgs.get(line["org"]) == org for line in lines)


def fleet_replicas(site) -> list[dict]:
    return [r for model in site.admin("GET", "/fleet").json()["models"] for r in model["replicas"]]
