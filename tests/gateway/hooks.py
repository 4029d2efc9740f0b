"""A safety hook for the tests: refuses any request whose body mentions 'forbidden'."""

from __future__ import annotations

import asyncio


async def refuse_forbidden(body: dict, prompt_token_ids: list[int]) -> str | None:
    await asyncio.sleep(0)  # a real hook would call a classifier
    return "this request was blocked by the safety check" if "forbidden" in str(body) else None
