"""`billing:` in fleet.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BillingSettings:
    """Prices per million tokens by model (the key "*" for models not named), and what one replica costs per hour
    (a GPU, or a CPU host), from which the cost of a million output tokens is derived."""

    replica_hour_usd: float = 0.0
    prices: dict = field(default_factory=dict)  # model -> {input, cached_input, output}, USD per 1M tokens

    def __post_init__(self) -> None:
        from tokenfleet.billing.prices import PriceTable

        if self.replica_hour_usd < 0:
            raise ValueError("replica_hour_usd must be >= 0")
        self.table = PriceTable.from_dict(self.prices)
