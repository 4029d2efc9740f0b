"""The safety-check hook: an async function the gateway calls for every request, concurrently with choosing a
replica. It returns a refusal message to block the request, or None to let it through."""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable

SafetyHook = Callable[[dict, list[int]], Awaitable[str | None]]


async def allow_all(body: dict, prompt_token_ids: list[int]) -> str | None:
    return None


def load_hook(spec: str | None) -> SafetyHook:
    """`package.module:function` -> that async function; None -> allow_all."""
    if not spec:
        return allow_all
    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise ValueError(f"safety hook {spec!r} must look like package.module:function")
    hook = getattr(importlib.import_module(module_name), attribute, None)
    if hook is None or not callable(hook):
        raise ValueError(f"safety hook {spec!r}: {module_name} has no function {attribute!r}")
    return hook
