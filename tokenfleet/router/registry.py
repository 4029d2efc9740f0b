"""The replica registry: replicas announce themselves in Redis with a heartbeat; gateways watch the live set.

Keys, all under one prefix (one prefix = one fleet):
  {prefix}{registry}:live     sorted set: replica name -> expiry time, in seconds on the Redis server's clock
  {prefix}{registry}:records  hash: replica name -> the ReplicaRecord as JSON
  {prefix}events              pub/sub channel: a replica's name each time its record changes or is withdrawn

Why a sorted set plus a hash rather than one key per replica with a TTL: a snapshot is one atomic script over two
keys, O(replicas), instead of a SCAN over a keyspace shared with quotas and streams (O(all keys), and not a
point-in-time view). Expiry is judged on Redis's clock (TIME inside the scripts), so skew between replica and
gateway clocks does not matter. A member whose score has passed is left out of every snapshot without anyone
deleting it (a kill -9'd replica is gone after ttl_s); every heartbeat of any replica reaps expired members, and
both keys carry a key TTL that heartbeats only ever extend, so a fleet that stops entirely leaves nothing behind.
The `{registry}` hash tag keeps both keys in one cluster slot. Pub/sub is only a hint that wakes watchers early:
a lost message costs at most one poll interval.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError, RedisError

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.client import PubSub

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "tokenfleet:replicas:"
# every way a Redis call can fail that the loops below ride out
REDIS_FAILURES = (RedisError, OSError, TimeoutError)

OnChange = Callable[[list["ReplicaRecord"], list["ReplicaRecord"]], "Awaitable[None] | None"]


@dataclass(frozen=True)
class ReplicaRecord:
    name: str  # unique in the fleet; the replica's host:port by default
    url: str  # base URL the gateway calls
    model: str  # the served model name
    pool: str = "default"  # region / pool name
    kind: str = "tokenfleet"  # or "openai" for an external OpenAI-compatible server
    draining: bool = False
    started_at: float = 0.0
    role: str = "both"  # both | prefill | decode (disaggregated prefill/decode)

    def to_json(self) -> str:
        # sorted keys: the scripts compare stored JSON byte for byte
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ReplicaRecord:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError(f"a replica record is a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})  # fields added later are ignored


@dataclass(frozen=True)
class RegistryKeys:
    live: str
    records: str
    events: str

    @classmethod
    def under(cls, prefix: str) -> RegistryKeys:
        check_prefix(prefix)
        return cls(f"{prefix}{{registry}}:live", f"{prefix}{{registry}}:records", f"{prefix}events")


def check_prefix(prefix: str) -> None:
    if "{" in prefix or "}" in prefix:
        raise ValueError(f"the registry prefix must not contain braces (they mark the hash tag), got {prefix!r}")


@dataclass(frozen=True)
class Script:
    source: str

    @property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()


REDIS_NOW = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) + tonumber(t[2]) / 1000000\n"

# Script pieces over KEYS[1] (live: name -> expiry, on the server's clock) and KEYS[2] (records: name -> JSON),
# after REDIS_NOW; autoscale.shared keeps the gateways' signal shares the same way.
# ARGV[1]: name, ARGV[2]: record JSON, ARGV[3]: ttl seconds. Reaps expired members, then writes the record with a
# fresh expiry and extends both keys' TTL; leaves `previous` (the record before) and `added` (1 if it was new).
UPSERT_RECORD = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, 100)
if #expired > 0 then
  redis.call('ZREM', KEYS[1], unpack(expired))
  redis.call('HDEL', KEYS[2], unpack(expired))
end
local ttl = tonumber(ARGV[3])
local previous = redis.call('HGET', KEYS[2], ARGV[1])
local added = redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local keep = math.ceil(ttl * 2000)
for _, key in ipairs(KEYS) do
  if redis.call('PTTL', key) < keep then redis.call('PEXPIRE', key, keep) end
end
"""

# Returns the JSON of every member whose expiry is still ahead.
LIVE_RECORDS = """
local names = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')
local out = {}
for i = 1, #names, 500 do
  local records = redis.call('HMGET', KEYS[2], unpack(names, i, math.min(i + 499, #names)))
  for _, record in ipairs(records) do
    if record then out[#out + 1] = record end
  end
end
return out
"""

# KEYS: live, records. ARGV: name, record JSON, ttl seconds, events channel.
_UPSERT = Script(
    REDIS_NOW
    + UPSERT_RECORD
    + """
if added == 1 or previous ~= ARGV[2] then redis.call('PUBLISH', ARGV[4], ARGV[1]) end
return added
"""
)

# KEYS: live, records. ARGV: name, record JSON, events channel. Removes the record only if it is still ours (a
# replica restarted under the same name may have replaced it).
_WITHDRAW = Script("""
local current = redis.call('HGET', KEYS[2], ARGV[1])
if current and current ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('PUBLISH', ARGV[3], ARGV[1])
return 1
""")

# KEYS: live, records.
_SNAPSHOT = Script(REDIS_NOW + LIVE_RECORDS)


async def run_script(redis: Redis, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
    try:
        return await redis.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:  # a restarted or failed-over server: EVAL runs it and caches it again
        return await redis.eval(script.source, len(keys), *keys, *args)


def _raise_if_cancelled() -> None:
    """redis-py awaits asyncio.wait_for, which on Python 3.11 swallows a cancellation that lands just as the inner
    await completes; the task is still marked as cancelling, so the loops honour the cancel here."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class Outage:
    """Logs the first failure of a run of failures and the recovery, not every retry."""

    def __init__(self, what: str) -> None:
        self.what, self.failing = what, False

    def failed(self, exc: BaseException) -> None:
        if not self.failing:
            log.warning("%s: Redis unreachable (%s: %s); retrying", self.what, type(exc).__name__, exc)
        self.failing = True

    def ok(self) -> None:
        if self.failing:
            log.info("%s: Redis reachable again", self.what)
        self.failing = False


class ReplicaAnnouncer:
    """Runs inside a replica: keeps its record in the registry while it serves.

    Writes are serialized, so a withdraw is never overtaken by a heartbeat that was already in flight; after
    withdraw() nothing is written again and run() returns."""

    def __init__(
        self,
        redis: Redis,
        record: ReplicaRecord,
        prefix: str = DEFAULT_PREFIX,
        ttl_s: float = 6.0,
        heartbeat_s: float = 2.0,
    ) -> None:
        if not 0 < heartbeat_s < ttl_s:
            raise ValueError(f"need 0 < heartbeat_s < ttl_s, got heartbeat_s={heartbeat_s}, ttl_s={ttl_s}")
        self.redis, self.record, self.keys = redis, record, RegistryKeys.under(prefix)
        self.ttl_s, self.heartbeat_s = ttl_s, heartbeat_s
        self._lock = asyncio.Lock()
        self._withdrawn = False
        self._outage = Outage(f"replica registry ({record.name})")

    async def run(self) -> None:
        """Upserts the record every heartbeat_s until cancelled or withdrawn; Redis failures wait for the next beat."""
        loop = asyncio.get_running_loop()
        while not self._withdrawn:
            started = loop.time()
            await self.beat()
            _raise_if_cancelled()
            await asyncio.sleep(max(0.0, started + self.heartbeat_s - loop.time()))

    async def beat(self) -> bool:
        """One upsert of the current record (with a fresh expiry). False if Redis failed or after withdraw()."""
        return await self._write(_UPSERT, repr(float(self.ttl_s)), self.keys.events)

    async def set_draining(self, draining: bool = True) -> bool:
        """Flips the draining flag and writes it at once (watchers are woken); later beats keep it."""
        self.record = dataclasses.replace(self.record, draining=draining)
        return await self.beat()

    async def withdraw(self) -> bool:
        """Removes the record at once and stops all further writes. False if Redis failed (it then expires)."""
        written = await self._write(_WITHDRAW, self.keys.events, final=True)
        if written:
            log.info("replica %s withdrawn from the registry", self.record.name)
        return written

    async def _write(self, script: Script, *extra: str, final: bool = False) -> bool:
        async with self._lock:
            if self._withdrawn:
                return False
            self._withdrawn = final
            # the record is read under the lock, so the latest draining flag is what lands
            args = [self.record.name, self.record.to_json(), *extra]
            try:
                async with asyncio.timeout(self.heartbeat_s):
                    await run_script(self.redis, script, [self.keys.live, self.keys.records], args)
            except REDIS_FAILURES as e:
                self._outage.failed(e)
                return False
            self._outage.ok()
            return True


class ReplicaRegistry:
    """Runs inside a gateway: reads the live replica set, and watches it for changes."""

    def __init__(self, redis: Redis, prefix: str = DEFAULT_PREFIX, poll_s: float = 1.0) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s must be positive, got {poll_s}")
        self.redis, self.keys, self.poll_s = redis, RegistryKeys.under(prefix), poll_s
        self.known: dict[str, ReplicaRecord] = {}  # the live set as of watch()'s last successful poll
        self._outage = Outage("replica registry watch")

    async def snapshot(self) -> list[ReplicaRecord]:
        """The live (unexpired) records, sorted by name. Raises Redis's errors; unreadable records are skipped."""
        raws = await run_script(self.redis, _SNAPSHOT, [self.keys.live, self.keys.records], [])
        records = []
        for raw in raws:
            try:
                records.append(ReplicaRecord.from_json(raw))
            except (ValueError, TypeError) as e:
                log.warning("skipping an unreadable replica record %r: %s", raw, e)
        return sorted(records, key=lambda r: r.name)

    async def watch(self, on_change: OnChange) -> None:
        """Polls every poll_s (sooner when a replica publishes a change) until cancelled, calling
        on_change(joined, left) whenever the live set differs from the last one reported.

        The first successful poll reports every live record as joined. A record that changes in place (its draining
        flag flips, or a replica restarts under the same name) is reported as left (the old record) and joined (the
        new one) in the same call, so a consumer keyed by name applies `left` first, then `joined`. Redis errors are
        logged and the last known set is kept; an exception raised by on_change is logged and the watch goes on."""
        wakeup = _Wakeup(self.redis, self.keys.events)
        try:
            while True:
                live = await self._poll()
                _raise_if_cancelled()
                if live is not None:
                    joined, left = diff(self.known, live)
                    self.known = live
                    if joined or left:
                        await _call(on_change, joined, left)
                await wakeup.wait(self.poll_s)
                _raise_if_cancelled()
        finally:
            await wakeup.close()

    async def _poll(self) -> dict[str, ReplicaRecord] | None:
        try:
            async with asyncio.timeout(max(self.poll_s, 1.0)):
                records = await self.snapshot()
        except REDIS_FAILURES as e:
            self._outage.failed(e)
            return None
        self._outage.ok()
        return {r.name: r for r in records}


def diff(
    before: dict[str, ReplicaRecord], after: dict[str, ReplicaRecord]
) -> tuple[list[ReplicaRecord], list[ReplicaRecord]]:
    """(joined, left) between two live sets keyed by name; a changed record is in both."""
    joined = [after[n] for n in sorted(after) if before.get(n) != after[n]]
    left = [before[n] for n in sorted(before) if after.get(n) != before[n]]
    return joined, left


async def _call(on_change: OnChange, joined: list[ReplicaRecord], left: list[ReplicaRecord]) -> None:
    try:
        result = on_change(joined, left)
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception(
            "replica registry: on_change failed (joined=%s, left=%s)", [r.name for r in joined], [r.name for r in left]
        )


class _Wakeup:
    """Sleeps up to a timeout, returning early when a message arrives on the registry's channel (or right after
    subscribing, since the poll before it may have missed a change)."""

    def __init__(self, redis: Redis, channel: str) -> None:
        self.redis, self.channel = redis, channel
        self.pubsub: PubSub | None = None

    async def wait(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            if self.pubsub is None:
                self.pubsub = self.redis.pubsub()
                async with asyncio.timeout(timeout):
                    await self.pubsub.subscribe(self.channel)
                return  # a change published before the subscription went unheard: poll once more now
            while (remaining := deadline - loop.time()) > 0:
                # subscribe confirmations come back as None at once; keep waiting for a real message
                if await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=remaining) is not None:
                    return
        except REDIS_FAILURES as e:
            log.debug("replica registry: change notifications unavailable (%s: %s)", type(e).__name__, e)
            await self.close()  # subscribe again next time
            await asyncio.sleep(max(0.0, deadline - loop.time()))

    async def close(self) -> None:
        pubsub, self.pubsub = self.pubsub, None
        if pubsub is not None:
            try:
                await pubsub.aclose()
            except REDIS_FAILURES:
                pass
