"""Takes the README's screenshots of the chat page and the operator console (docs/screenshots/*.png) from a real
`tokenfleet serve --auth` on the demo model: `python -m tests.web.screenshots`. tests/web/test_screenshots.py checks
that they are there, decode, and are not older than the pages they show."""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

from tests.web.conftest import ADMIN_KEY, SETTINGS, chromium_path, send, serving, set_options, sign_in, wait_status
from tokenfleet.model.demo import write_demo_checkpoint

OUT = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
VIEWPORT = {"width": 1280, "height": 800}


def some_usage(base: str, org: str, requests: int) -> None:
    key = httpx.post(
        f"{base}/admin/v1/keys",
        json={"org": org, "user": "demo", "tier": "paid"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    ).json()["key"]
    for _ in range(requests):
        httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        ).raise_for_status()


def take(folder: Path) -> None:
    model = write_demo_checkpoint(folder / "tiny", size="tiny", seed=0)
    with serving(model, folder, SETTINGS) as site, sync_playwright() as playwright:
        key = site.new_key(org="acme")
        for org, requests in (("acme", 3), ("globex", 5), ("initech", 2)):
            some_usage(site.base, org, requests)
        browser = playwright.chromium.launch(executable_path=chromium_path())
        page = browser.new_page(viewport=VIEWPORT)
        sign_in(page, site.base, key)
        set_options(page, {"max_tokens": 24, "temperature": 0})
        page.locator("summary", has_text="Settings").click()  # closed again, as a person leaves it
        send(page, "Plan a weekend by the sea")
        wait_status(page, "complete")
        page.get_by_role("button", name="New chat").click()
        page.get_by_label("System prompt").fill("You are a concise assistant.")
        send(page, "Write a haiku about <b>markup</b> that stays text")
        wait_status(page, "complete")
        page.screenshot(path=OUT / "chat.png")

        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        page.goto(f"{site.base}/console")
        page.get_by_label("Admin key").fill(ADMIN_KEY)
        page.get_by_role("button", name="Sign in").click()
        page.locator("#usage table").wait_for()
        page.locator("#keys tr[data-key-id]").first.wait_for()
        page.screenshot(path=OUT / "console.png")
        browser.close()


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as temp:
        take(Path(temp))
    print(f"wrote {OUT / 'chat.png'} and {OUT / 'console.png'}")
