"""The Redis side of the quota: key names, running scripts by their SHA (loading them on NOSCRIPT), and turning every
way Redis can be unreachable into QuotaStoreError, within a hard deadline.

Script calls are batched (batcher.py): the calls of one event-loop tick go to Redis as pipelined writes of EVALSHA
commands, up to MAX_BATCH a write, each on a connection of its own, and their replies are read back in order. Each
is still its own script call, atomic on its own, exactly as if it had been sent alone; only the round trips are
shared. Calls that can also run inside a batch script (BatchOp, from an OpTemplate: the quota's reserves and
reconciles) go further: those of one write go as ONE call of that script (BatchCall), which runs them in order with
the effects and replies of single calls made one after the other (lua.BATCH), and each caller gets its own reply.

Per call the client does as little as it can: a script called over and over with the same keys and most of the same
arguments (a quota scope set's reserve and reconcile) is packed once as a CallTemplate, and a call packs only the
values that change (a request id, a token count); the store's batches run on connections of its own, kept between
batches, instead of taking one from the client's pool and giving it back each time."""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:  # the sentinel redis-py's hiredis parser has its reader return when a reply is incomplete
    from redis._parsers.hiredis import NOT_ENOUGH_DATA
except ImportError:  # another redis-py: replies are read through read_response only
    NOT_ENOUGH_DATA = None

from tokenfleet.quota.base import QuotaStoreError
from tokenfleet.quota.batcher import TickBatcher

UNREACHABLE = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ReadOnlyError,
    ClusterDownError,
    TryAgainError,
    OSError,
    asyncio.TimeoutError,
)


# Script calls per write. A tick's calls beyond it go out as further writes on other connections, at the same time:
# with two or more batches in flight Redis runs one while this process answers another, instead of the two taking
# turns (64 in flight on 2 cores: ~4,800 pairs/s in one write of 64, 7,500-10,400 in two of 32; batches of 8 at 16
# in flight gained nothing: a batch's own costs, a write, a read and two wake-ups, then outweigh the overlap).
MAX_BATCH = 32


class Script:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        # the command's name and its script, packed: what EVALSHA and EVAL of the same call differ in
        self.by_sha = bulk("EVALSHA") + bulk(self.sha)
        self.by_source = bulk("EVAL") + bulk(source)


class Call(Protocol):
    @property
    def script(self) -> Script: ...

    def packed(self, by_sha: bool = True) -> bytes:
        """The whole command: EVALSHA (or EVAL with the source), numkeys, keys, args."""


@dataclass(frozen=True, slots=True)
class ScriptCall:
    script: Script
    keys: Sequence[str]
    args: Sequence[Any]  # str, bytes, int or float

    def packed(self, by_sha: bool = True) -> bytes:
        head = ("EVALSHA", self.script.sha) if by_sha else ("EVAL", self.script.source)
        packed: bytes = hiredis.pack_command((*head, len(self.keys), *self.keys, *self.args))
        return packed


@dataclass(slots=True)
class PackedCall:
    """A call whose numkeys, keys and args are packed already (`body`); `argc`: the command's elements in all."""

    script: Script
    argc: int
    body: bytes

    def packed(self, by_sha: bool = True) -> bytes:
        return b"*%d\r\n%s%s" % (self.argc, self.script.by_sha if by_sha else self.script.by_source, self.body)


@dataclass(frozen=True, slots=True)
class CallTemplate:
    """Calls of one script with the same keys and arguments but for a run in the middle: the last `variable_keys`
    keys, then the first `variable_args` arguments. What stays the same is packed once, here."""

    script: Script
    argc: int
    head: bytes  # numkeys and the fixed keys
    tail: bytes  # the fixed arguments
    variables: int

    @classmethod
    def of(
        cls, script: Script, keys: Sequence[str], variable_keys: int, variable_args: int, args: Sequence[str | int]
    ) -> CallTemplate:
        numkeys = len(keys) + variable_keys
        head, tail = bulks((numkeys, *keys)), bulks(args)
        return cls(script, 3 + numkeys + variable_args + len(args), head, tail, variable_keys + variable_args)

    def call(self, *values: str | int) -> PackedCall:
        if len(values) != self.variables:
            raise ValueError(f"this template takes {self.variables} values, got {len(values)}")
        return PackedCall(self.script, self.argc, self.head + bulks(values) + self.tail)


@dataclass(frozen=True, slots=True)
class OpTemplate:
    """A CallTemplate whose calls can also run as operations of a batch script (`batch`, e.g. lua.BATCH): one call of
    the batch script takes, in order, each operation's keys (its single call's keys) as its keys, and each
    operation's `kind` then its single call's arguments as its arguments. A batch of one goes as the single call."""

    single: CallTemplate
    batch: Script
    keys: bytes  # the fixed keys, packed
    kind: bytes  # the kind argument, packed
    nkeys: int  # keys per call
    nargs: int  # arguments per call in the batch, the kind included
    variable_keys: int

    @classmethod
    def of(
        cls,
        script: Script,
        batch: Script,
        kind: str,
        keys: Sequence[str],
        variable_keys: int,
        variable_args: int,
        args: Sequence[str | int],
    ) -> OpTemplate:
        return cls.packed(
            script, batch, kind, bulks(keys), len(keys), variable_keys, variable_args, bulks(args), len(args)
        )

    @classmethod
    def packed(
        cls,
        script: Script,
        batch: Script,
        kind: str,
        keys: bytes,
        nkeys: int,
        variable_keys: int,
        variable_args: int,
        args: bytes,
        nargs: int,
    ) -> OpTemplate:
        """As `of`, from the fixed keys and the fixed arguments packed already (bulks), and their counts."""
        numkeys = nkeys + variable_keys
        argc = 3 + numkeys + variable_args + nargs
        single = CallTemplate(script, argc, bulk(numkeys) + keys, args, variable_keys + variable_args)
        return cls(single, batch, keys, bulk(kind), numkeys, 1 + variable_args + nargs, variable_keys)

    def call(self, *values: str | int) -> BatchOp:
        if len(values) != self.single.variables:
            raise ValueError(f"this template takes {self.single.variables} values, got {len(values)}")
        split = self.variable_keys
        if split:
            return BatchOp(self, bulks(values[:split]), bulks(values[split:]))
        return BatchOp(self, b"", bulks(values))


@dataclass(slots=True)
class BatchOp:
    """One call of an OpTemplate: its variable keys and arguments, packed. Alone, the single script's call."""

    template: OpTemplate
    keys: bytes
    args: bytes

    @property
    def script(self) -> Script:
        return self.template.single.script

    def packed(self, by_sha: bool = True) -> bytes:
        single = self.template.single
        script = single.script.by_sha if by_sha else single.script.by_source
        return b"*%d\r\n%s%s%s%s%s" % (single.argc, script, single.head, self.keys, self.args, single.tail)


@dataclass(slots=True)
class BatchCall:
    """Operations of one batch script as one call of it; its reply is a list of their replies, in order."""

    script: Script
    ops: list[BatchOp]

    def packed(self, by_sha: bool = True) -> bytes:
        nkeys = nargs = 0
        keys: list[bytes] = []
        args: list[bytes] = []
        for op in self.ops:
            template = op.template
            nkeys += template.nkeys
            nargs += template.nargs
            keys += (template.keys, op.keys)
            args += (template.kind, op.args, template.single.tail)
        script = self.script.by_sha if by_sha else self.script.by_source
        return b"*%d\r\n%s%s%s%s" % (3 + nkeys + nargs, script, bulk(nkeys), b"".join(keys), b"".join(args))


def combine(calls: Sequence[Call]) -> tuple[list[Call], list[tuple[int, int]]]:
    """The calls as they go out: the BatchOps of each batch script as one BatchCall, where the first of them was (a
    lone op goes as its single call), every other call as it is. Returns what goes out and, per call, where its reply
    will be: (index in what goes out, index in that BatchCall's reply or -1)."""
    head = calls[0] if calls else None
    if type(head) is BatchOp:  # the usual batch: reserves and reconciles only
        batch = head.template.batch
        if all(type(call) is BatchOp and call.template.batch is batch for call in calls):
            if len(calls) == 1:
                return [head], [(0, -1)]
            return [BatchCall(batch, list(calls))], [(0, i) for i in range(len(calls))]  # type: ignore[arg-type]
    sent: list[Call] = []
    where: list[tuple[int, int]] = []
    groups: dict[Script, tuple[int, int]] = {}  # batch script -> (index in sent, index in calls of its first op)
    for call in calls:
        if type(call) is BatchOp:
            batch = call.template.batch
            group = groups.get(batch)
            if group is None:
                groups[batch] = (len(sent), len(where))
                where.append((len(sent), -1))
                sent.append(call)
                continue
            at, first = group
            carrier = sent[at]
            if type(carrier) is BatchOp:  # its second op: the batch call starts
                carrier = sent[at] = BatchCall(batch, [carrier])
                where[first] = (at, 0)
            assert isinstance(carrier, BatchCall)
            where.append((at, len(carrier.ops)))
            carrier.ops.append(call)
        else:
            where.append((len(sent), -1))
            sent.append(call)
    return sent, where


def split_replies(sent: Sequence[Call], where: Sequence[tuple[int, int]], replies: Sequence[Any]) -> list[Any]:
    """Each call's reply, from the replies to what went out (combine): a BatchCall's reply is the list of its ops'
    replies; an error reply to a BatchCall as a whole is every op's (each its own copy)."""
    if len(sent) == 1 and where[0][1] == 0:  # one BatchCall carries them all
        reply = replies[0]
        if isinstance(reply, list) and len(reply) == len(where):
            return reply
    answers: list[Any] = []
    for at, index in where:
        reply = replies[at]
        if index < 0:
            answers.append(reply)
        elif isinstance(reply, list) and len(reply) == len(sent[at].ops):  # type: ignore[attr-defined]
            answers.append(reply[index])
        elif isinstance(reply, BaseException):
            answers.append(_copy(reply))
        else:
            answers.append(ResponseError(f"a batch call got a reply that is not one per call: {reply!r:.200}"))
    return answers


def _copy(error: BaseException) -> BaseException:
    try:
        return type(error)(*error.args)
    except Exception:
        return error


def bulks(values: Sequence[str | int | bytes]) -> bytes:
    """RESP bulk strings, one after the other: str as UTF-8, int in decimal (as hiredis packs them)."""
    if len(values) <= 4:  # a call's few values: formatted here, at about half the cost of hiredis's round trip
        out = b""
        for value in values:
            if type(value) is str:
                data = value.encode()
            elif type(value) is int:
                data = b"%d" % value
            else:
                return _packed_bulks(values)
            out += b"$%d\r\n%b\r\n" % (len(data), data)
        return out
    return _packed_bulks(values)


def _packed_bulks(values: Sequence[str | int | bytes]) -> bytes:
    if not values:
        return b""
    items: tuple[Any, ...] = tuple(values)  # (hiredis's stub types the tuple as one of a single element)
    packed: bytes = hiredis.pack_command(items)
    return packed[packed.index(b"\n") + 1 :]  # without the array's header, "*<count>\r\n"


def bulk(value: str | int | bytes) -> bytes:
    return bulks((value,))


def connect(
    url: str, *, connect_timeout_s: float = 0.25, socket_timeout_s: float = 0.25, max_connections: int = 16
) -> aioredis.Redis:
    """A client for the quota: short timeouts, and no retries, because a script whose reply was lost may have run
    (retrying a reserve would charge twice). A bounded pool whose callers queue for a free connection."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=None,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
    return aioredis.Redis(connection_pool=pool)


class RedisStore:
    """At most `max_in_flight` batches of script calls talk to Redis at once; the others queue here, outside the
    deadline, so a burst is not mistaken for an outage. A call that fails marks the time: the calls of batches that
    were queued before then fail at once instead of each paying its own timeout."""

    def __init__(self, client: aioredis.Redis, prefix: str, call_timeout_s: float, max_in_flight: int = 16) -> None:
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"the key prefix must not contain braces (they mark the hash tag), got {prefix!r}")
        if call_timeout_s <= 0 or max_in_flight < 1:
            raise ValueError("call_timeout_s must be positive and max_in_flight at least 1")
        self.client, self.prefix, self.call_timeout_s = client, prefix, call_timeout_s
        self.batcher: TickBatcher[Call] = TickBatcher(self._run_batch, MAX_BATCH)
        self._slots = asyncio.Semaphore(max_in_flight)
        self._failed_at = float("-inf")
        # the batches' connections: made from the client's pool settings, at most max_in_flight (one per batch in
        # flight), kept between batches; a connection that failed is disconnected and connects again when next used
        self._idle: list[AbstractConnection] = []
        self._made: list[AbstractConnection] = []

    def key(self, tag: str, *parts: str) -> str:
        """`{prefix}{tag}:part:...`: every key of one request carries the same hash tag, so one cluster slot."""
        return f"{self.prefix}{{{tag}}}:" + ":".join(parts)

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """The script's reply; QuotaStoreError when Redis cannot be reached in time, ResponseError when it fails."""
        return await self.batcher.submit(ScriptCall(script, keys, args))

    async def run_call(self, call: Call) -> Any:
        """As run, for a call packed already (CallTemplate.call)."""
        return await self.batcher.submit(call)

    async def command(self, *args: Any) -> Any:
        return await self._bounded(lambda: self.client.execute_command(*args))

    async def close(self) -> None:
        """Waits for the batches in flight (each ends within the deadline), then closes the batches' connections."""
        await self.batcher.wait_idle()
        made, self._made, self._idle = self._made, [], []
        for connection in made:
            await connection.disconnect()

    async def _run_batch(self, calls: list[Call]) -> list[Any]:
        queued = time.monotonic()
        async with self._slots:
            if self._failed_at > queued:
                return [QuotaStoreError(QUEUED_IN_OUTAGE) for _ in calls]
            sent, where = combine(calls)
            connection = self._connection()
            try:
                async with asyncio.timeout(self.call_timeout_s):
                    replies = split_replies(sent, where, await run_scripts_on(connection, sent, math.inf))
            except UNREACHABLE as e:
                self._failed_at = time.monotonic()
                return [QuotaStoreError(f"quota store unreachable: {type(e).__name__}: {e}") for _ in calls]
            finally:
                self._idle.append(connection)
        for i, reply in enumerate(replies):
            if isinstance(reply, UNREACHABLE):  # e.g. LOADING, READONLY: Redis answered, but cannot decide
                self._failed_at = time.monotonic()
                replies[i] = QuotaStoreError(f"quota store unreachable: {type(reply).__name__}: {reply}")
        return replies

    def _connection(self) -> AbstractConnection:
        if self._idle:
            return self._idle.pop()
        connection: AbstractConnection = self.client.connection_pool.make_connection()
        self._made.append(connection)
        return connection

    async def _bounded(self, call: Callable[[], Awaitable[Any]]) -> Any:
        queued = time.monotonic()
        async with self._slots:
            if self._failed_at > queued:
                raise QuotaStoreError(QUEUED_IN_OUTAGE)
            try:
                async with asyncio.timeout(self.call_timeout_s):
                    return await call()
            except UNREACHABLE as e:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    # the caller was cancelled and the client's clean-up turned that into a timeout or connection
                    # error: honour the cancellation (a task that swallows it never ends)
                    raise asyncio.CancelledError() from e
                self._failed_at = time.monotonic()
                raise QuotaStoreError(f"quota store unreachable: {type(e).__name__}: {e}") from e


QUEUED_IN_OUTAGE = "quota store unreachable (failed while this call was queued)"


async def run_scripts(
    client: aioredis.Redis,
    calls: Sequence[Call],
    read_timeout_s: float | None = None,
    on_sent: Callable[[], None] | None = None,
) -> list[Any]:
    """The calls' replies, in order, from one write on one connection of the client's pool (run_scripts_on)."""
    pool = client.connection_pool
    connection = await pool.get_connection()
    try:
        return await run_scripts_on(connection, calls, read_timeout_s, on_sent)
    finally:
        await pool.release(connection)


async def run_scripts_on(
    connection: AbstractConnection,
    calls: Sequence[Call],
    read_timeout_s: float | None = None,
    on_sent: Callable[[], None] | None = None,
) -> list[Any]:
    """The calls' replies, in order, from one write on `connection` (connected first if it is not); an error reply
    is returned in its place, not raised. Scripts Redis does not know (NOSCRIPT: a restarted or failed-over server)
    are sent again with their source, which also caches them there. A connection error is retried as the
    connection's own retry policy says (redis-py's `retry`); a timeout or a lost connection raises, and leaves the
    connection disconnected (replies may be left unread on it). `read_timeout_s`: per reply (None: the client's
    socket timeout; math.inf: none, the caller keeps a deadline of its own). `on_sent`: called once, as soon as the
    whole write is in the kernel's hands (it reaches Redis even if this process dies now), else with the replies."""
    sent = Once(on_sent)

    async def exchange() -> list[Any]:
        replies = await _exchange(connection, [call.packed() for call in calls], read_timeout_s, sent)
        unknown = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if unknown:
            again = await _exchange(connection, [calls[i].packed(by_sha=False) for i in unknown], read_timeout_s)
            for i, reply in zip(unknown, again):
                replies[i] = reply
        return replies

    async def disconnect(error: Exception) -> None:
        await connection.disconnect()

    try:
        replies: list[Any] = await connection.retry.call_with_retry(exchange, disconnect)
        sent()
        return replies
    except BaseException:
        await connection.disconnect(nowait=True)
        raise


class Once:
    """A callback called at most once (None: nothing to call)."""

    def __init__(self, callback: Callable[[], None] | None) -> None:
        self.callback = callback

    def __call__(self) -> None:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


async def _exchange(
    connection: AbstractConnection, packed: list[bytes], read_timeout_s: float | None, sent: Once | None = None
) -> list[Any]:
    """Sends the packed commands in one write and reads one reply per command; an error reply is returned. `sent` is
    called once the write has left this process (asyncio hands a small write to the kernel at once; one it had to
    buffer has not, and `sent` then waits for the replies).

    Replies already received and parsed are taken straight from the connection's hiredis reader, when it has one
    (most of a batch arrives with its first reply); redis-py's read_response, a chain of coroutines per reply, is
    called only to wait for more."""
    await connection.send_packed_command(b"".join(packed))
    if sent is not None and _unsent_bytes(connection) == 0:
        sent()
    replies: list[Any] = []
    reader = _hiredis_reader(connection)
    while len(replies) < len(packed):
        if reader is not None:
            reply = reader.gets()
            if reply is not NOT_ENOUGH_DATA:
                if isinstance(reply, RedisConnectionError):  # e.g. LOADING: raised, as redis-py does
                    raise reply
                replies.append(reply)
                continue
        try:
            replies.append(await connection.read_response(timeout=read_timeout_s))
        except ResponseError as e:
            replies.append(e)
    return replies


def _unsent_bytes(connection: AbstractConnection) -> int:
    """Bytes of the connection's writes still in this process (-1: cannot tell)."""
    writer = getattr(connection, "_writer", None)
    transport = getattr(writer, "transport", None)
    try:
        return int(transport.get_write_buffer_size()) if transport is not None else -1
    except Exception:
        return -1


def _hiredis_reader(connection: AbstractConnection) -> hiredis.Reader | None:
    """The hiredis reader under redis-py's parser on this connection, if that is what parses its replies (RESP2,
    errors as ResponseError values, NOT_ENOUGH_DATA when it needs more bytes); None: read through redis-py only."""
    parser = getattr(connection, "_parser", None)
    reader = getattr(parser, "_reader", None)
    if NOT_ENOUGH_DATA is None or getattr(connection, "protocol", 2) not in (2, "2", None):
        return None
    return reader if isinstance(reader, hiredis.Reader) else None


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
