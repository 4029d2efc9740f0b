"""`metering:` in fleet.yaml."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MeteringSettings:
    """Usage events: outbox (the tenants' database) -> event log (a Redis Stream in a fleet) -> warehouse table."""

    stream_key: str = "tokenfleet:usage"  # the Redis Stream
    group: str = "warehouse"  # its consumer group
    consumer: str = ""  # this gateway's warehouse writer; default: the host name (a restart resumes its entries)
    write_warehouse: bool = True  # run a warehouse writer here (a fleet may run fewer writers than gateways)
    lease_s: float = 30.0  # a request's open row outlives a dead gateway this long, then is closed as failed
    checkpoint_s: float = 2.0  # how often running requests' counts are saved and their leases renewed
    batch_s: float = 0.002  # outbox opens and closes that queue within this share one statement (group commit)
    close_batch_s: float = 0.1  # the close of a request whose row is open waits at most this for a batch to join
    ship_interval_s: float = 0.5
    keep_sent_s: float = 3600.0  # shipped outbox rows are purged after this (once the warehouse has them)
    reship_after_s: float = 300.0  # a shipped event the warehouse lacks this long after is shipped again

    def __post_init__(self) -> None:
        if not 0 < self.checkpoint_s < self.lease_s:
            raise ValueError("need 0 < checkpoint_s < lease_s")
        if not 0 <= self.batch_s <= self.close_batch_s < self.checkpoint_s:
            raise ValueError("need 0 <= batch_s <= close_batch_s < checkpoint_s")
        if not self.ship_interval_s > 0 or not self.keep_sent_s > 0 or not self.reship_after_s > 0:
            raise ValueError("ship_interval_s, keep_sent_s and reship_after_s must be positive")
