"""The price table: USD per million input, cached input and output tokens, per model."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT = "*"  # the entry for models the table does not name


@dataclass(frozen=True)
class ModelPrice:
    input: float = 0.0  # USD per million prompt tokens not served from the prefix cache
    cached_input: float = 0.0  # USD per million prompt tokens served from the prefix cache
    output: float = 0.0  # USD per million generated tokens

    def __post_init__(self) -> None:
        for name in ("input", "cached_input", "output"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a price >= 0 (USD per million tokens), got {value!r}")

    def cost(self, input_tokens: int, cached_tokens: int, output_tokens: int) -> float:
        """USD for these counts; cached tokens are part of input_tokens, billed at the cached price."""
        fresh = input_tokens - cached_tokens
        return (fresh * self.input + cached_tokens * self.cached_input + output_tokens * self.output) / 1e6


@dataclass(frozen=True)
class PriceTable:
    prices: dict[str, ModelPrice]

    @classmethod
    def from_dict(cls, raw: dict | None) -> PriceTable:
        """`billing.prices` in fleet.yaml: {model: {input, cached_input, output}}; cached_input defaults to input."""
        prices = {}
        for model, spec in (raw or {}).items():
            if not isinstance(spec, dict):
                raise ValueError(f"prices.{model}: give input, cached_input and output (USD per million tokens)")
            spec = dict(spec)
            spec.setdefault("cached_input", spec.get("input", 0.0))
            try:
                prices[str(model)] = ModelPrice(**spec)
            except (TypeError, ValueError) as e:
                raise ValueError(f"prices.{model}: {e}") from None
        return cls(prices)

    def price(self, model: str) -> ModelPrice:
        return self.prices.get(model) or self.prices.get(DEFAULT) or ModelPrice()
