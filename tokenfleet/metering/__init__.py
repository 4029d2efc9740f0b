"""Usage metering that never loses or doubles an event: at request end the gateway writes a UsageEvent to the
outbox (the tenants' SQL database), the OutboxShipper moves it to the event log (a Redis Stream with a consumer
group in a fleet, MemoryLog embedded), and the WarehouseWriter inserts it into `usage_events` idempotently on
request_id, acking only after the insert."""

from tokenfleet.metering.event import STATUSES, UsageEvent
from tokenfleet.metering.log import EventLog
from tokenfleet.metering.memory_log import MemoryLog
from tokenfleet.metering.outbox import Outbox
from tokenfleet.metering.redis_log import RedisStreamLog
from tokenfleet.metering.shipper import OutboxShipper
from tokenfleet.metering.warehouse import WarehouseWriter

__all__ = [
    "STATUSES",
    "EventLog",
    "MemoryLog",
    "Outbox",
    "OutboxShipper",
    "RedisStreamLog",
    "UsageEvent",
    "WarehouseWriter",
]
