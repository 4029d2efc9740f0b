"""Stored responses in the tenants' database, every query scoped by the owner (organisation and user), so another
user's response ids are simply not found; and the chain of earlier turns a previous_response_id stands for."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from sqlalchemy import delete, select

from tokenfleet.store.db import Database
from tokenfleet.store.models import ResponseRow
from tokenfleet.store.records import NotFound, Owner

ID_PATTERN = re.compile(r"resp_[0-9a-f]{32}")
MAX_CHAIN = 256  # turns a previous_response_id may reach back through


@dataclass(frozen=True)
class StoredResponse:
    id: str
    request_id: str
    previous_response_id: str | None
    messages: list[dict]  # its input, as chat messages
    body: dict  # the response object

    def turn(self) -> list[dict]:
        """What the next response of the chain sees of this one: its input, then its reply (its text, its
        reasoning, and the function calls it made as the reply's tool_calls)."""
        output = self.body.get("output", [])
        reply: dict = {
            "role": "assistant",
            "content": "".join(
                part.get("text", "")
                for item in output
                if item.get("type") == "message"
                for part in item.get("content", [])
            ),
        }
        reasoning = "".join(
            part.get("text", "")
            for item in output
            if item.get("type") == "reasoning"
            for part in item.get("content") or []
        )
        if reasoning:
            reply["reasoning_content"] = reasoning  # for templates that keep an earlier turn's thinking
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in output
            if item.get("type") == "function_call"
        ]
        if calls:
            reply["tool_calls"] = calls
        return [*self.messages, reply]


class ResponseStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def save(self, owner: Owner, response: StoredResponse) -> None:
        async with self.db.session() as session, session.begin():
            session.add(
                ResponseRow(
                    id=response.id,
                    org_id=owner.org_id,
                    user_id=owner.user_id,
                    previous_response_id=response.previous_response_id,
                    request_id=response.request_id,
                    status=response.body.get("status", ""),
                    messages=json.dumps(response.messages),
                    body=json.dumps(response.body),
                )
            )

    async def get(self, owner: Owner, response_id: str) -> StoredResponse:
        if not ID_PATTERN.fullmatch(response_id):
            raise NotFound(f"no response {response_id[:80]!r}")
        async with self.db.session() as session:
            query = select(ResponseRow).where(
                ResponseRow.id == response_id, ResponseRow.org_id == owner.org_id, ResponseRow.user_id == owner.user_id
            )
            row = (await session.execute(query)).scalar_one_or_none()
        if row is None:
            raise NotFound(f"no response {response_id!r}")
        return StoredResponse(
            row.id, row.request_id, row.previous_response_id, json.loads(row.messages), json.loads(row.body)
        )

    async def delete(self, owner: Owner, response_id: str) -> None:
        await self.get(owner, response_id)
        async with self.db.session() as session, session.begin():
            await session.execute(delete(ResponseRow).where(ResponseRow.id == response_id))

    async def history(self, owner: Owner, response_id: str) -> list[dict]:
        """The chat messages of the chain that ends with this response, oldest first."""
        turns: list[list[dict]] = []
        next_id: str | None = response_id
        while next_id is not None:
            if len(turns) == MAX_CHAIN:
                raise NotFound(f"the chain of previous responses is longer than {MAX_CHAIN}")
            stored = await self.get(owner, next_id)
            turns.append(stored.turn())
            next_id = stored.previous_response_id
        return [message for turn in reversed(turns) for message in turn]
