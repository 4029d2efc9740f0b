"""A gateway with the conversations API, in process (ASGI) over stand-in replicas or the real engine, its users
authenticated with real API keys from the test database; and an SSE reader."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

import httpx

from tests.gateway.inprocess import MODEL, inprocess_gateway
from tokenfleet.config import default_tiers
from tokenfleet.conversations.routes import add_conversation_routes
from tokenfleet.conversations.service import ConversationService
from tokenfleet.conversations.settings import ConversationSettings
from tokenfleet.gateway.app import create_gateway_app
from tokenfleet.gateway.auth import Authenticator
from tokenfleet.gateway.gateway import Gateway
from tokenfleet.store.db import Database
from tokenfleet.store.tenants import TenantStore


class SlowUpstream:
    """Stands in for a replica: `count` tokens ("w0 ", "w1 ", ...) `delay` seconds apart, usage on every chunk (as
    ours reports it), then finish_reason `finish`. Remembers each request's kind and body; `running` counts
    streams open right now (a cancelled reply must close its stream)."""

    kind = "tokenfleet"

    def __init__(self, count: int = 5, delay: float = 0.0, finish: str = "length", name: str = "slow") -> None:
        self.count, self.delay, self.finish, self.name = count, delay, finish, name
        self.requests: list[tuple[str, dict]] = []
        self.running = 0

    async def stream(self, kind: str, body: dict):
        self.requests.append((kind, body))
        self.running += 1
        try:
            for i in range(self.count):
                await asyncio.sleep(self.delay)
                last = i == self.count - 1
                piece = f"w{i} "
                choice = {
                    "index": 0,
                    "finish_reason": self.finish if last else None,
                    **({"delta": {"content": piece}} if kind == "chat" else {"text": piece}),
                }
                yield {
                    "id": "x",
                    "choices": [choice],
                    "usage": {"prompt_tokens": 7, "completion_tokens": i + 1, "total_tokens": 8 + i},
                }
            yield {
                "id": "x",
                "choices": [],
                "usage": {"prompt_tokens": 7, "completion_tokens": self.count, "total_tokens": 7 + self.count},
            }
        finally:
            self.running -= 1

    async def load(self) -> dict:
        return {}


@dataclass
class Users:
    keys: dict[str, str] = field(default_factory=dict)  # "ann", "eve" -> API key

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}


async def with_users(gateway: Gateway, db: Database) -> Users:
    """Real keys in the test database: ann and bob in one organisation, eve in another."""
    tenants = TenantStore(db)
    users = Users()
    for org, user in (("acme", "ann"), ("acme", "bob"), ("rival", "eve")):
        _, users.keys[user] = await tenants.create_key(org, user, tier="paid")
    gateway.auth = Authenticator(tenants, default_tiers())
    return users


@asynccontextmanager
async def conversations_app(model_dir, db: Database, upstreams: list, window: int | None = None, **settings):
    """(client, service, users) over an in-process gateway with the conversations routes on `db`; `window`: the
    model's context window as the gateway knows it (512 unless given)."""
    gateway = inprocess_gateway(model_dir, upstreams)
    if window is not None:
        gateway.models[MODEL] = replace(gateway.models[MODEL], max_model_len=window)
    users = await with_users(gateway, db)
    installed: list[ConversationService] = []
    app = create_gateway_app(
        gateway,
        lambda app: installed.append(add_conversation_routes(app, gateway, db, ConversationSettings(**settings))),
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30) as client:
        try:
            yield client, installed[0], users
        finally:
            await installed[0].close()


def parse_sse(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each event in an SSE body (comments and pings skipped)."""
    events = []
    for block in text.split("\n\n"):
        name, data = "message", []
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            events.append((name, json.loads("\n".join(data))))
    return events


def reply_text(events: list[tuple[str, dict]]) -> str:
    return "".join(data["text"] for name, data in events if name == "token")


async def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02):
    """Polls an async predicate until it returns something truthy."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = await predicate()
        if result or asyncio.get_running_loop().time() > deadline:
            return result
        await asyncio.sleep(interval)


__all__ = ["SlowUpstream", "Users", "conversations_app", "parse_sse", "reply_text", "wait_for"]
