"""tokenfleet: a multi-tenant LLM serving platform."""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # loaded on first use: the gateway, the CLI's `keys` and the tests of non-model parts need no PyTorch
    if name == "LLM":
        from tokenfleet.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenfleet.engine.request import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tokenfleet' has no attribute {name!r}")
