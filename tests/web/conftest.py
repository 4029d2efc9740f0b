"""The pages in a real browser: Debian's Chromium driven by Playwright, against a real `tokenfleet serve --auth`
process (keys in SQLite, quotas in memory). Browser downloads are impossible here: .ci/run installs the chromium
package and the tests pass its path."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from tests.servers import free_port, running_process

MODEL = "tiny"
ADMIN_KEY = "web-admin-key"
FREE_RPM = 12  # a free user's requests per minute: the 13th within a minute is refused with a retry time of ~5 s
SETTINGS = {
    "admin_key": ADMIN_KEY,
    "conversations": {"save_interval_s": 0.2},
    "billing": {"prices": {MODEL: {"input": 1.0, "cached_input": 0.5, "output": 4.0}}},
    "tiers": {"free": {"priority": 1, "weight": 2, "user_limits": {"requests_per_minute": FREE_RPM}}},
    "safety_hook": "tests.gateway.hooks:refuse_forbidden",  # refuses any request that mentions 'forbidden'
}
# long enough to still be generating when a test reloads or cuts the connection, however fast the machine
LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}
PROMPT = "Tell me about the sea."


def chromium_path() -> str:
    path = os.environ.get("TOKENFLEET_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).is_file():
        pytest.fail("no Chromium: `apt-get install -y chromium` (.ci/run does), or set TOKENFLEET_CHROMIUM")
    return path


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_path())
        yield chromium
        chromium.close()


@dataclass
class Site:
    base: str
    log: Path
    references: dict = field(default_factory=dict)  # (content, options) -> the reply an uninterrupted run gives

    def admin(self, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.request(method, f"{self.base}/admin/v1{path}", headers=headers, timeout=10, **kwargs)

    def new_key(self, tier: str = "paid", org: str | None = None, user: str = "ann") -> str:
        org = org or f"org-{uuid.uuid4().hex[:8]}"
        response = self.admin("POST", "/keys", json={"org": org, "user": user, "tier": tier})
        assert response.status_code == 201, response.text
        return response.json()["key"]

    def reference_reply(self, content: str = PROMPT, options: dict | None = None) -> str:
        """The reply the conversations API streams for `content` as a conversation's first message, uninterrupted
        (greedy: the same for every conversation that starts the same way, whoever starts it)."""
        options = options or LONG
        cache_key = (content, json.dumps(options, sort_keys=True))
        if cache_key not in self.references:
            self.references[cache_key] = stream_reply(self.base, self.new_key(), content, options)
        return self.references[cache_key]


def stream_reply(base: str, key: str, content: str, options: dict) -> str:
    auth = {"Authorization": f"Bearer {key}"}
    conversation = httpx.post(f"{base}/v1/conversations", json={}, headers=auth, timeout=10).json()
    text, done = [], None
    with httpx.stream(
        "POST",
        f"{base}/v1/conversations/{conversation['id']}/messages",
        json={"content": content, **options},
        headers=auth,
        timeout=60,
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] == "token":
                    text.append(event["text"])
                elif event["type"] == "done":
                    done = event
    assert done is not None and done["status"] == "complete", done
    return "".join(text)


@contextmanager
def serving(model_dir: Path, folder: Path, settings: dict, auth: bool = True):
    (folder / "fleet.yaml").write_text(yaml.safe_dump(settings))
    port = free_port()
    args = [
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--kv-cache-gib",
        "0.05",
        "--swap-space-gib",
        "0.01",
        "--max-model-len",
        "2048",
        "--config",
        str(folder / "fleet.yaml"),
        "--database-url",
        f"sqlite:///{folder / 'tokenfleet.db'}",
        *(["--auth"] if auth else []),
    ]
    with running_process(args, f"http://127.0.0.1:{port}/health", folder / "serve.log"):
        yield Site(f"http://127.0.0.1:{port}", folder / "serve.log")


@pytest.fixture(scope="session")
def site(demo_model_dir, tmp_path_factory) -> Site:
    """`tokenfleet serve --auth`, for the whole web suite."""
    with serving(demo_model_dir, tmp_path_factory.mktemp("web"), SETTINGS) as running:
        yield running


@pytest.fixture
def context(browser):
    """A fresh browser profile (no stored keys) per test; the page's console errors fail the test."""
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    errors: list[str] = []
    context.on("weberror", lambda error: errors.append(str(error.error)))
    yield context
    context.close()
    assert errors == [], f"uncaught errors in the page: {errors}"


class InBackground:
    """Runs a context manager (servers starting) on a thread of its own, so that it starts while other tests run;
    `get()` waits for it. The thread lives until `close()`: the servers' processes die with the thread that
    started them (PR_SET_PDEATHSIG in tests/servers.py)."""

    def __init__(self, manager: AbstractContextManager) -> None:
        self.manager, self.value, self.error = manager, None, None
        self._entered, self._leave = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="start-in-background", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with self.manager as value:
                self.value = value
                self._entered.set()
                self._leave.wait()
        except BaseException as e:  # handed to the test that needs it
            self.error = e
        finally:
            self._entered.set()

    def get(self):
        self._entered.wait()
        if self.error is not None:
            raise self.error
        return self.value

    def close(self) -> None:
        self._leave.set()
        self._thread.join(60)


@pytest.fixture(scope="session", autouse=True)
def fleet_in_background(request):
    """When this session runs tests/web/test_fleet.py, its fleet (three processes) starts at once, alongside the
    other tests, instead of after them: the suite's wall time, not its work, is what this saves."""
    if not any(item.path.name == "test_fleet.py" and item.path.parent.name == "web" for item in request.session.items):
        yield None
        return
    from tests.web.test_fleet import start_fleet

    starting = InBackground(
        start_fleet(request.getfixturevalue("demo_model_dir"), request.getfixturevalue("tmp_path_factory"))
    )
    yield starting
    starting.close()


# --- acting on the chat page ---------------------------------------------------------------------------------------


def sign_in(page, base: str, key: str) -> None:
    page.goto(f"{base}/")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_label("Message").wait_for()


def set_options(page, options: dict) -> None:
    page.locator("summary", has_text="Settings").click()
    page.get_by_label("Max tokens").fill(str(options.get("max_tokens", "")))
    page.get_by_label("Temperature").fill(str(options.get("temperature", "")))
    page.get_by_label("Ignore end of sequence").set_checked(bool(options.get("ignore_eos")))


def send(page, content: str) -> None:
    page.get_by_label("Message").fill(content)
    page.get_by_role("button", name="Send").click()


def last_reply(page):
    return page.locator("li.message.assistant").last


def reply_text(page) -> str:
    return last_reply(page).locator(".text").text_content() or ""


def wait_until(condition: Callable[[], object], timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_status(page, status: str, timeout: float = 60.0) -> None:
    """The last reply reaches `status` (complete, stopped, failed)."""
    wait_until(lambda: last_reply(page).get_attribute("data-status") == status, timeout, f"the reply to be {status}")
