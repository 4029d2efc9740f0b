#!/usr/bin/env python3
"""Usage metering benchmark: events per second through outbox -> event log -> warehouse, and the lag from a
request's end to its warehouse row under served load. Run by hand, never from the test suite:

    python bench/metering.py                                    # report: docs/benchmarks/metering.md + .json
    python bench/metering.py --parts pipeline --events 500 --repeats 1 --out ''      # quick check, no report
    python bench/metering.py --rerender docs/benchmarks/metering.json --note "..."   # add notes, rewrite the md

Backends (--backends): `embedded` = SQLite outbox and warehouse (one file, as `tokenfleet serve` has) + MemoryLog;
`fleet` = PostgreSQL outbox and warehouse (a throwaway database on the server the tests use, $TOKENFLEET_TEST_POSTGRES
or 127.0.0.1:5432, dropped at the end) + a Redis Stream with a consumer group (--redis, keys under a unique prefix,
deleted at the end). The real classes throughout: Outbox, OutboxShipper, MemoryLog / RedisStreamLog and
WarehouseWriter, with the gateway's default settings.

Part `pipeline`, per backend, each stage --repeats times on empty tables and an empty log (medians reported):
  floor                  --events empty transactions (a session, BEGIN, SELECT 1, COMMIT) by --writers concurrent
                         coroutines: what any one-transaction write costs before it writes anything.
  Outbox.close alone     --events Outbox.close calls by --writers coroutines (a row nobody opened: the upsert
                         inserts it; one transaction). Events/s and p50/p99 of one call.
  recorder               --events requests through the gateway's UsageRecorder: all started (their opens written as
                         the recorder groups them), then all finished (their closes), timed until every write is
                         done (UsageRecorder.flush). Failed writes (the recorder's warnings) are counted.
  recorder, unbatched    the same with batch_s=0: a batch is whatever queued while the previous one was written.
  recorder burst         each request started and finished at once, as in an overloaded gateway: an open not yet
                         written when its request ends is skipped, the close inserts the row.
  recorder, sequential   --sequential-events requests one at a time, as a lightly loaded gateway sees them: started,
                         10 ms later finished, then wait until its writes are done (flush). CPU per request is net of
                         what the same 10 ms waits cost with no request (measured just before).
  ship                   --bulk-events closed rows already in the outbox; OutboxShipper.ship_once (batches of 500:
                         read pending, publish, mark sent) until none is pending.
  warehouse              --bulk-events entries already in the log; WarehouseWriter.drain_once (read 500, insert with
                         ON CONFLICT DO NOTHING, ack) until all are written.
  end to end             the `recorder` stage (open + close) while OutboxShipper.run and WarehouseWriter.run run
                         in the same process and event loop (as in a gateway, default settings); the clock stops
                         when the writer has inserted every event. Also: lag (usage_events.created_at - ended_at,
                         from each request's end, so it includes waiting behind the other closes) at p50/p99, and a
                         check that the table holds exactly the events written.
Per run: wall time, this process's CPU time per event, database connections the engine opened (its pool keeps 5,
and closes overflow connections as they come back), and "other CPU": machine CPU not used by this process, by
the PostgreSQL backends of the benchmark's database or by redis-server, as a share of all cores (bench/_cpuprobe.py;
above 10 %, contended).

Part `lag`, per system (--systems): `serve` = `tokenfleet serve` (embedded: SQLite in the run dir, MemoryLog);
`gateway` = `tokenfleet replica` + `tokenfleet gateway` whose fleet file has the throwaway PostgreSQL database and
Redis (resume buffer, quotas, replica registry and the usage stream under the unique prefix). The load is
bench/served_load.py's: its checkpoint, workload (Poisson arrivals at each of --lag-rates, --lag-requests requests
per rate, prompts 16-512 tokens, max_tokens 8-256, streaming, ignore_eos), warm-up and client. When the load is done
the harness waits for the warehouse to hold one row per request, then reads `usage_events`: lag = created_at
(set by the warehouse writer) - ended_at (set by the gateway when the request ended), p50/p99 per rate and overall;
rows are matched to the requests sent by x-request-id: none missing, none extra, none doubled.

Output: a markdown report (--out) and a JSON next to it; server logs and raw rows stay in the run dir.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]
import redis  # noqa: E402
from _common import (  # noqa: E402
    CONTENDED,
    bench_parser,
    command_line,
    git_head,
    known_names,
    make_run_dir,
    pct,
    repo_env,
    report_to_rerender,
    wait_idle,
)
from _cpuprobe import CpuProbe  # noqa: E402
from offline_throughput import checkpoint_info, ensure_checkpoint, machine_info  # noqa: E402
from served_load import (  # noqa: E402
    ADMIN_KEY,
    SERVED_NAME,
    PortAllocator,
    Server,
    auth_headers,
    gateway_env,
    make_workload,
    run_rate,
    run_warmup,
    summarize,
    tokenfleet_cmd,
    write_fleet_yaml,
)
from sqlalchemy import event, select, text  # noqa: E402

from tests.store.backends import POSTGRES_ADMIN_URL, create_postgres_database, database_url, drop_postgres_database  # noqa: E402
from tokenfleet.metering import MemoryLog, Outbox, OutboxShipper, RedisStreamLog, UsageEvent, WarehouseWriter  # noqa: E402
from tokenfleet.metering.log import EventLog  # noqa: E402
from tokenfleet.metering.log import log as metering_log  # noqa: E402
from tokenfleet.metering.outbox import OUTBOX  # noqa: E402
from tokenfleet.metering.recorder import UsageRecorder  # noqa: E402
from tokenfleet.metering.sql import insert_ignoring  # noqa: E402
from tokenfleet.store.db import Database  # noqa: E402
from tokenfleet.store.models import UsageEventRow, utcnow  # noqa: E402

STAGES = [
    "transaction",
    "outbox_close",
    "recorder",
    "recorder_unbatched",
    "recorder_burst",
    "recorder_sequential",
    "ship",
    "warehouse",
    "end_to_end",
]
STAGE_LABELS = {
    "transaction": "floor: one empty transaction (SELECT 1) per event",
    "outbox_close": "Outbox.close alone (one transaction per event)",
    "recorder": "UsageRecorder: open + close of every request",
    "recorder_unbatched": "the same with batch_s 0 (batches form only behind a write in flight)",
    "recorder_burst": "UsageRecorder: requests that start and end at once (opens skipped)",
    "recorder_sequential": "UsageRecorder: one request at a time (10 ms each), net CPU per request",
    "ship": "ship (outbox -> log)",
    "warehouse": "warehouse writes (log -> usage_events)",
    "end_to_end": "**end to end**",
}
RECORDER_OPTIONS = {"recorder_unbatched": {"batch_s": 0.0}}  # UsageRecorder options other than the defaults
BACKEND_LABELS = {
    "embedded": "embedded: SQLite + MemoryLog + SQLite",
    "fleet": "fleet: PostgreSQL + Redis Stream + PostgreSQL",
}
SYSTEM_LABELS = {
    "serve": "tokenfleet serve (embedded: SQLite, MemoryLog)",
    "gateway": "tokenfleet gateway + replica (fleet: PostgreSQL, Redis Stream)",
}
TIERS = ("enterprise", "paid", "free", "batch")
SEQUENTIAL_REQUEST_S = 0.01


# ----------------------------------------------------------------------------------------------------------------- #
# events and backends
# ----------------------------------------------------------------------------------------------------------------- #


def usage_event(tag: str, i: int, final: bool = True) -> UsageEvent:
    """A plausible event ending now (the provisional one of an open row has no output yet)."""
    latency = 1.0 + (i % 40) / 10
    end = utcnow()
    return UsageEvent(
        request_id=f"chatcmpl-{tag}-{i:07d}",
        org_id=f"org_{i % 50:04d}",
        user_id=f"user_{i % 500:05d}",
        key_id=f"key_{i % 500:05d}",
        model="demo-2026-01-01",
        replica="http://10.0.3.17:8100",
        pool="eu-west",
        tier=TIERS[i % 4],
        input_tokens=200 + i % 800,
        cached_tokens=(i % 7) * 16,
        output_tokens=(i % 256) if final else 0,
        ttft_s=0.12,
        latency_s=latency,
        status="finished",
        route="demo@2026-01-01 pool=eu-west replica=http://10.0.3.17:8100 reason=prefix matched=12",
        started_at=end - timedelta(seconds=latency),
        ended_at=end,
        engine_s=0.4,
    )


@dataclass
class Backend:
    """Where a run's outbox, log and warehouse live: fresh tables and a fresh log per run."""

    kind: str  # embedded | fleet
    run_dir: Path
    postgres_url: str | None = None  # the throwaway database (fleet)
    redis_url: str | None = None
    prefix: str = ""  # Redis keys of this benchmark

    async def open(self, name: str) -> tuple[Database, EventLog]:
        if self.kind == "embedded":
            db = Database(f"sqlite:///{self.run_dir / f'pipeline-{name}.db'}")
            await db.migrate()
            return db, MemoryLog()
        db = Database(self.postgres_url)
        await empty_usage_tables(db)
        return db, RedisStreamLog.from_url(self.redis_url, f"{self.prefix}usage:{name}")

    async def empty(self) -> None:
        async with Database(self.postgres_url) as db:
            await empty_usage_tables(db)

    async def server_pids(self, db: Database) -> list[int]:
        """The PostgreSQL backends serving the benchmark's database (`db` is one of its clients), and
        redis-server: their CPU is the benchmark's. (redis-server also serves anyone else using it meanwhile.)"""
        if self.kind == "embedded":
            return []
        query = text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        async with db.session() as session:
            pids = list((await session.execute(query)).scalars())
        return pids + [int(redis.Redis.from_url(self.redis_url).info("server")["process_id"])]


async def empty_usage_tables(db: Database) -> None:
    async with db.session() as session, session.begin():
        await session.execute(text("TRUNCATE usage_outbox, usage_events RESTART IDENTITY"))


async def count_rows(db: Database) -> tuple[int, int]:
    """(rows, distinct request ids) in usage_events."""
    query = text("SELECT count(*), count(DISTINCT request_id) FROM usage_events")
    async with db.session() as session:
        rows, distinct = (await session.execute(query)).one()
    return rows, distinct


async def lags(db: Database) -> list[float]:
    """created_at - ended_at of every warehouse row, seconds."""
    async with db.session() as session:
        rows = (await session.execute(select(UsageEventRow.ended_at, UsageEventRow.created_at))).all()
    return [(created - ended).total_seconds() for ended, created in rows]


# ----------------------------------------------------------------------------------------------------------------- #
# pipeline stages
# ----------------------------------------------------------------------------------------------------------------- #


async def concurrently(op: Callable[[int], Awaitable[None]], events: int, writers: int) -> list[float]:
    """`writers` coroutines call op(i) for i in 0..events-1 between them; returns each call's time (s)."""
    indexes, latencies = iter(range(events)), []

    async def writer() -> None:
        for i in indexes:  # shared: each index is taken once
            start = time.perf_counter()
            await op(i)
            latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(writer() for _ in range(writers)))
    return latencies


def latency_fields(latencies: list[float]) -> dict:
    return {
        "write_p50_ms": 1e3 * pct(latencies, 50),
        "write_p99_ms": 1e3 * pct(latencies, 99),
        "write_max_ms": 1e3 * max(latencies),
    }


async def close_events(outbox: Outbox, tag: str, events: int, writers: int) -> tuple[list[float], dict[str, int]]:
    """Outbox.close of each event (a row nobody opened: UPDATE, then INSERT), and the failed writes by error. A
    failed close is tried again after 0.1 s, as UsageRecorder would later."""
    errors: dict[str, int] = {}

    async def close(i: int) -> None:
        while True:
            try:
                await outbox.close(usage_event(tag, i))
                return
            except Exception as e:  # noqa: BLE001
                name = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                errors[name] = errors.get(name, 0) + 1
                await asyncio.sleep(0.1)

    return await concurrently(close, events, writers), errors


async def record(recorder: UsageRecorder, tag: str, events: int, burst: bool, deadline_s: float) -> None:
    """`events` requests through the recorder, returning when every write is done (failed closes retried, as the
    recorder's own loop does). Not a burst: all start, their opens are written, then all end (two writes per
    request). A burst: each starts and ends at once, as in an overloaded gateway (an open that never had its turn
    is skipped: the close inserts the row)."""
    for i in range(events):
        opened = usage_event(tag, i, final=False)
        recorder.started(opened.request_id, lambda opened=opened: opened)
        if burst:
            recorder.finished(usage_event(tag, i))
    if not burst:
        await recorder.flush()
        for i in range(events):
            recorder.finished(usage_event(tag, i))
    deadline = time.monotonic() + deadline_s
    await recorder.flush()
    while recorder.unsaved and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        await recorder.flush()


class WarningCount(logging.Handler):
    """Counts the metering log's warnings (failed writes the recorder retries or leaves to the close)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        error = record.args[-1] if isinstance(record.args, tuple) and record.args else None
        key = str(record.msg).split(" %s")[0]  # e.g. "usage outbox: could not close", without the request id
        if isinstance(error, BaseException):
            key += f": {type(error).__name__}: {str(error).splitlines()[0][:80] if str(error) else ''}"
        self.count[key] = self.count.get(key, 0) + 1

    def __enter__(self) -> WarningCount:
        metering_log.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        metering_log.removeHandler(self)


async def fill_outbox(db: Database, tag: str, events: int) -> None:
    """Closed, unsent rows, written in bulk (not timed)."""
    rows = [
        {
            "request_id": e.request_id,
            "payload": e.to_json(),
            "created_at": utcnow(),
            "sent_at": None,
            "lease_until": None,
        }
        for e in (usage_event(tag, i) for i in range(events))
    ]
    async with db.session() as session, session.begin():
        await insert_ignoring(session, OUTBOX, rows, key="request_id")


async def fill_log(log: EventLog, tag: str, events: int) -> None:
    for start in range(0, events, 500):
        await log.publish([usage_event(tag, i) for i in range(start, min(events, start + 500))])


async def stage_outbox_close(db: Database, log: EventLog, tag: str, n: int, args) -> Callable:
    outbox = Outbox(db)

    async def work() -> dict:
        latencies, errors = await close_events(outbox, tag, n, args.writers)
        return latency_fields(latencies) | {"write_errors": errors}

    return work


async def stage_recorder(db: Database, log: EventLog, tag: str, n: int, args, stage: str, options: dict) -> Callable:
    recorder = UsageRecorder(Outbox(db), **options)
    idle_cpu_s = await idle_cpu(n) if stage == "recorder_sequential" else 0.0

    async def work() -> dict:
        with WarningCount() as warnings:
            if stage == "recorder_sequential":
                await record_sequential(recorder, tag, n)
            else:
                await record(recorder, tag, n, stage == "recorder_burst", args.drain_timeout)
        return {"write_errors": warnings.count, "unsaved": len(recorder.unsaved), "idle_cpu_s": idle_cpu_s}

    return work


async def record_sequential(recorder: UsageRecorder, tag: str, events: int) -> None:
    for i in range(events):
        opened = usage_event(tag, i, final=False)
        recorder.started(opened.request_id, lambda opened=opened: opened)
        await asyncio.sleep(SEQUENTIAL_REQUEST_S)
        recorder.finished(usage_event(tag, i))
        await recorder.flush()


async def idle_cpu(events: int) -> float:
    """This process's CPU time over `events` waits of SEQUENTIAL_REQUEST_S with nothing else to do."""
    cpu = time.process_time()
    for _ in range(events):
        await asyncio.sleep(SEQUENTIAL_REQUEST_S)
    return time.process_time() - cpu


async def stage_transaction(db: Database, n: int, args) -> Callable:
    """The floor under every outbox write: a session, BEGIN, one trivial statement, COMMIT (no row written)."""

    async def one(_: int) -> None:
        async with db.session() as session, session.begin():
            await session.execute(text("SELECT 1"))

    async def work() -> dict:
        return latency_fields(await concurrently(one, n, args.writers))

    return work


async def stage_ship(db: Database, log: EventLog, tag: str, n: int, args) -> Callable:
    outbox = Outbox(db)
    await fill_outbox(db, tag, n)
    shipper = OutboxShipper(outbox, log)

    async def work() -> dict:
        while await shipper.ship_once():
            pass
        return {"shipped": shipper.shipped, "left": await outbox.pending_count()}

    return work


async def stage_warehouse(db: Database, log: EventLog, tag: str, n: int, args) -> Callable:
    await fill_log(log, tag, n)
    writer = WarehouseWriter(db, log, "bench-writer")

    async def work() -> dict:
        while writer.written < n and await writer.drain_once(block_ms=0):
            pass
        return {"written": writer.written, "duplicates": writer.duplicates}

    return work


async def stage_end_to_end(db: Database, log: EventLog, tag: str, n: int, args) -> Callable:
    outbox = Outbox(db)
    recorder = UsageRecorder(outbox)
    shipper, writer = OutboxShipper(outbox, log), WarehouseWriter(db, log, "bench-writer")

    async def work() -> dict:
        services = [asyncio.create_task(shipper.run()), asyncio.create_task(writer.run())]
        start = time.perf_counter()
        try:
            with WarningCount() as warnings:
                await record(recorder, tag, n, False, args.drain_timeout)
            written_s = time.perf_counter() - start
            deadline = time.monotonic() + args.drain_timeout
            while writer.written < n and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        finally:
            for task in services:
                task.cancel()
            await asyncio.gather(*services, return_exceptions=True)
        tail = time.perf_counter() - start - written_s  # after the last outbox write, until the last row
        return {
            "outbox_s": written_s,
            "tail_s": tail,
            "written": writer.written,
            "duplicates": writer.duplicates,
            "write_errors": warnings.count,
        }

    return work


async def check_end_to_end(db: Database, result: dict, events: int) -> None:
    """Lag percentiles and exactly-once, read after the timed window."""
    rows, distinct = await count_rows(db)
    lag = await lags(db)
    result.update(
        rows=rows,
        distinct=distinct,
        exact=rows == distinct == events,
        lag_p50_ms=1e3 * pct(lag, 50),
        lag_p99_ms=1e3 * pct(lag, 99),
        lag_max_ms=1e3 * max(lag),
    )


async def run_stage(backend: Backend, stage: str, rep: int, args) -> dict:
    tag = f"{stage}-{rep}-{uuid.uuid4().hex[:6]}"
    n = {"ship": args.bulk_events, "warehouse": args.bulk_events, "recorder_sequential": args.sequential_events}.get(
        stage, args.events
    )
    db, log = await backend.open(tag)
    try:
        if stage == "transaction":
            work = await stage_transaction(db, n, args)
        elif stage.startswith("recorder"):
            work = await stage_recorder(db, log, tag, n, args, stage, RECORDER_OPTIONS.get(stage, {}))
        elif stage == "outbox_close":
            work = await stage_outbox_close(db, log, tag, n, args)
        else:
            work = await {"ship": stage_ship, "warehouse": stage_warehouse, "end_to_end": stage_end_to_end}[stage](
                db, log, tag, n, args
            )
        connects = connections_opened(db)
        result = await timed(work, lambda: backend.server_pids(db))
        result["connections_opened"] = connects[0]
        if stage == "end_to_end":
            await check_end_to_end(db, result, n)
    finally:
        if isinstance(log, RedisStreamLog):
            await log.redis.delete(log.stream_key)
        await log.close()
        await db.close()
    result.update(
        stage=stage,
        rep=rep,
        events=n,
        per_s=n / result["wall_s"],
        cpu_us_per_event=1e6 * (result["process_cpu_s"] - result.get("idle_cpu_s", 0.0)) / n,
        server_cpu_us_per_event=1e6 * (result["server_cpu_s"] or 0) / n,
    )
    return result


def connections_opened(db: Database) -> list[int]:
    """A counter of the database connections the engine opens from now on."""
    count = [0]

    def opened(*_: object) -> None:
        count[0] += 1

    event.listen(db.engine.sync_engine, "connect", opened)
    return count


async def timed(work: Callable[[], Awaitable[dict]], pids: Callable[[], Awaitable[list[int]]]) -> dict:
    """Runs `work`, with its wall time, this process's CPU time and the other CPU load meanwhile."""
    probe = CpuProbe()
    probe.start(await pids())
    cpu, start = time.process_time(), time.perf_counter()
    result = await work()
    wall = time.perf_counter() - start
    result.update(wall_s=wall, process_cpu_s=time.process_time() - cpu)
    result["others_cpu"] = probe.stop(wall, await pids())
    result["server_cpu_s"] = probe.pids_cpu_s
    return result


def median_row(runs: list[dict]) -> dict:
    """Medians over repetitions of every numeric field."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "rep"]
    row = {
        k: statistics.median(r[k] for r in runs if r.get(k) is not None)
        for k in keys
        if any(r.get(k) is not None for r in runs)
    }
    row.update(
        stage=runs[0]["stage"],
        runs=len(runs),
        others_cpu_each=[_round(r.get("others_cpu")) for r in runs],
        per_s_each=[round(r["per_s"]) for r in runs],
    )
    if "exact" in runs[0]:
        row["exact"] = all(r["exact"] for r in runs)
    if "write_errors" in runs[0]:  # summed over the runs
        row["write_errors"] = {
            k: sum(r["write_errors"].get(k, 0) for r in runs)
            for k in sorted({k for r in runs for k in r["write_errors"]})
        }
    return row


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def pipeline_part(backend: Backend, args) -> list[dict]:
    rows = []
    for stage in args.stages:
        busy = wait_idle(args.wait_idle, f"{backend.kind} {stage}")
        runs = [asyncio.run(run_stage(backend, stage, rep, args)) for rep in range(args.repeats)]
        rows.append(median_row(runs) | {"cpu_busy_before": busy, "raw": runs})
        r = rows[-1]
        print(
            f"[{backend.kind}] {stage}: {r['per_s']:.0f} events/s (runs {r['per_s_each']}), "
            f"{r['connections_opened']:.0f} connections opened, "
            f"{r['cpu_us_per_event']:.0f} us CPU/event in this process, other CPU {r['others_cpu_each']}"
            + (
                f", lag p50/p99 {r['lag_p50_ms']:.0f}/{r['lag_p99_ms']:.0f} ms, exactly once: {r['exact']}"
                if stage == "end_to_end"
                else ""
            )
            + (
                f", write p50/p99/max {r['write_p50_ms']:.0f}/{r['write_p99_ms']:.0f}/{r['write_max_ms']:.0f} ms"
                if "write_p50_ms" in r
                else ""
            )
            + (f", failed writes (retried) {r['write_errors']}" if r.get("write_errors") else ""),
            flush=True,
        )
    return rows


# ----------------------------------------------------------------------------------------------------------------- #
# lag under served load
# ----------------------------------------------------------------------------------------------------------------- #


def served_args(args) -> argparse.Namespace:
    """What bench/served_load.py's helpers read from their own command line, with its defaults."""
    return argparse.Namespace(
        model=args.model,
        size=args.size,
        builtin_checkpoint=False,
        ckpt_root=args.ckpt_root,
        seed=0,
        num_requests=args.lag_requests,
        prompt_min=16,
        prompt_max=512,
        output_min=8,
        output_max=256,
        overhead_requests=0,
        threads=args.threads,
        kv_cache_gib=args.kv_cache_gib,
        tokenfleet_args="",
    )


def fleet_extra(backend: Backend) -> dict:
    """The fleet file's PostgreSQL and Redis, every Redis key under the benchmark's prefix."""
    p = backend.prefix
    return {
        "database_url": backend.postgres_url,
        "redis_url": backend.redis_url,
        "redis_prefix": p + "stream:",
        "quota": {"prefix": p + "quota:"},
        "routing": {"register_prefix": p + "replicas:"},
        "metering": {"stream_key": p + "usage:served", "consumer": "bench-gateway"},
    }


def lag_servers(
    system: str, sargs, model_dir: Path, run_dir: Path, ports, backend: Backend | None
) -> tuple[list[Server], str]:
    """(servers in start order, the database URL the gateway meters into)."""
    env = repo_env(sargs.threads)
    if system == "serve":  # a database of its own
        url = f"sqlite:///{run_dir / 'serve.db'}"
        p = ports()
        cmd = tokenfleet_cmd("serve", sargs, model_dir, p) + ["--database-url", url]
        return [Server("serve", cmd, p, env, run_dir / "log_serve.txt", run_dir)], url
    asyncio.run(backend.empty())  # the pipeline part's rows are gone
    rp, gp = ports(), ports()
    cfg = run_dir / "fleet.yaml"
    write_fleet_yaml(cfg, model_dir, gp, rp, run_dir / "unused.db", fleet_extra(backend))
    replica = Server(
        "replica", tokenfleet_cmd("replica", sargs, model_dir, rp), rp, env, run_dir / "log_replica.txt", run_dir
    )
    gateway = Server(
        "gateway",
        [sys.executable, "-m", "tokenfleet", "gateway", "--config", str(cfg)],
        gp,
        gateway_env(sargs),
        run_dir / "log_gateway.txt",
        run_dir,
    )
    gateway.admin_key = ADMIN_KEY
    return [replica, gateway], backend.postgres_url


async def warehouse_rows(url: str) -> list[dict]:
    async with Database(url) as db, db.session() as session:
        rows = (
            await session.execute(
                select(
                    UsageEventRow.request_id,
                    UsageEventRow.ended_at,
                    UsageEventRow.created_at,
                    UsageEventRow.output_tokens,
                    UsageEventRow.status,
                )
            )
        ).all()
    return [
        {"request_id": r[0], "ended_at": r[1], "created_at": r[2], "output_tokens": r[3], "status": r[4]} for r in rows
    ]


def wait_for_rows(url: str, ids: set[str], timeout: float) -> list[dict]:
    """Every warehouse row, once the requests `ids` all have one (or at the timeout)."""
    deadline = time.monotonic() + timeout
    rows = asyncio.run(warehouse_rows(url))
    while not ids <= {r["request_id"] for r in rows} and time.monotonic() < deadline:
        time.sleep(0.5)
        rows = asyncio.run(warehouse_rows(url))
    return rows


def lag_stats(rows: list[dict]) -> dict:
    lag = [(r["created_at"] - r["ended_at"]).total_seconds() for r in rows]
    return {
        "rows": len(rows),
        "lag_p50_ms": _ms(pct(lag, 50)),
        "lag_p99_ms": _ms(pct(lag, 99)),
        "lag_max_ms": _ms(max(lag, default=None)),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def account(rows: list[dict], sent: list[dict]) -> dict:
    """Warehouse rows against the requests the client sent (matched by x-request-id)."""
    ids = [r.get("request_id") for r in sent]
    by_id = {r["request_id"]: r for r in rows}
    client_tokens = sum(r["output_tokens"] for r in sent if r["ok"])
    return {
        "sent": len(sent),
        "without_id": ids.count(None),
        "missing": len(set(ids) - set(by_id) - {None}),
        "extra": len(set(by_id) - set(ids)),
        "doubled": len(ids) - len(set(ids)),  # one id for two requests
        "statuses": dict(sorted(Counter(r["status"] for r in rows).items())),
        "output_tokens_client": client_tokens,
        "output_tokens_warehouse": sum(by_id[i]["output_tokens"] for i in ids if i in by_id),
    }


def run_lag_system(
    system: str, args, sargs, model_dir: Path, wl: dict, run_dir: Path, ports, backend: Backend | None
) -> dict:
    servers, url = lag_servers(system, sargs, model_dir, run_dir, ports, backend)
    row: dict = {
        "system": system,
        "label": SYSTEM_LABELS[system],
        "rates": {},
        "commands": [" ".join(shlex.quote(c) for c in s.cmd) for s in servers],
    }
    sent: list[dict] = []
    by_rate: dict[str, set[str]] = {}  # the request ids of each rate
    try:
        for s in servers:
            s.start()
            s.wait_healthy(args.start_timeout)
        target = servers[-1]
        headers = auth_headers(target)
        sent += asyncio.run(run_warmup(system, target.base, SERVED_NAME, wl["warmup"], headers))
        for rate, reqs in wl["rates"].items():
            probe = CpuProbe()
            probe.start(server_pids(system, backend))
            t = time.perf_counter()
            recs, wall = asyncio.run(run_rate(system, target.base, SERVED_NAME, reqs, 90.0, headers))
            others = probe.stop(time.perf_counter() - t, server_pids(system, backend))
            sent += recs
            by_rate[rate] = {r["request_id"] for r in recs if r.get("request_id")}
            load = summarize(recs, wall, 2.0, 0.1)
            row["rates"][rate] = {
                "load": {
                    k: load[k]
                    for k in ("requests", "completed", "req_s", "output_tok_s", "ttft_p50", "e2e_p99", "errors")
                },
                "others_cpu": others,
            }
        t = time.perf_counter()
        rows = wait_for_rows(url, {r["request_id"] for r in sent if r.get("request_id")}, args.drain_timeout)
        row["settle_s"] = time.perf_counter() - t
    finally:
        for s in reversed(servers):
            s.stop(20.0)
    for rate, ids in by_rate.items():
        row["rates"][rate].update(lag_stats([r for r in rows if r["request_id"] in ids]))
    row["overall"] = lag_stats(rows) | account(rows, sent)
    (run_dir / f"rows_{system}.json").write_text(json.dumps(rows, default=str))
    o = row["overall"]
    print(
        f"[{system}] {o['rows']} rows for {o['sent']} requests (missing {o['missing']}, extra {o['extra']}, "
        f"doubled {o['doubled']}); lag p50/p99 {o['lag_p50_ms']:.0f}/{o['lag_p99_ms']:.0f} ms; per rate "
        + ", ".join(
            f"{k}/s: {v['lag_p50_ms']:.0f}/{v['lag_p99_ms']:.0f} ms (others {_pc(v['others_cpu'])})"
            for k, v in row["rates"].items()
        ),
        flush=True,
    )
    return row


def server_pids(system: str, backend: Backend | None) -> list[int]:
    """The gateway's PostgreSQL backends and redis-server (`tokenfleet serve` is all in the benchmark's tree)."""
    if system != "gateway":
        return []

    async def pids() -> list[int]:
        async with Database(backend.postgres_url) as db:
            return await backend.server_pids(db)

    return asyncio.run(pids())


def lag_part(args, backend: Backend | None, run_dir: Path) -> tuple[list[dict], dict]:
    sargs = served_args(args)
    model_dir, source = ensure_checkpoint(sargs)
    wl = make_workload(sargs, model_dir, args.lag_rates)
    ports = PortAllocator(args.base_port)
    rows = []
    for system in args.systems:
        busy = wait_idle(args.wait_idle, system)
        rows.append(
            run_lag_system(system, args, sargs, model_dir, wl, run_dir, ports, backend) | {"cpu_busy_before": busy}
        )
    return rows, {"dir": str(model_dir), "source": source, "info": checkpoint_info(model_dir)}


# ----------------------------------------------------------------------------------------------------------------- #
# setup, report, main
# ----------------------------------------------------------------------------------------------------------------- #


def fleet_backend(args, run_dir: Path) -> tuple[Backend, Callable[[], None]]:
    """A throwaway PostgreSQL database (migrated) and a unique Redis prefix; the cleanup drops both."""
    name = create_postgres_database()
    backend = Backend("fleet", run_dir, database_url(name), args.redis, f"tfbench:metering:{uuid.uuid4().hex}:")

    async def migrate() -> None:
        async with Database(backend.postgres_url) as db:
            await db.migrate()

    asyncio.run(migrate())

    def cleanup() -> None:
        drop_postgres_database(name)
        client = redis.Redis.from_url(args.redis)
        keys = list(client.scan_iter(match=backend.prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
        print(f"dropped database {name}; deleted {len(keys)} Redis keys under {backend.prefix}", flush=True)

    return backend, cleanup


def versions(redis_url: str) -> dict:
    from importlib.metadata import version

    v = {pkg: version(pkg) for pkg in ("sqlalchemy", "aiosqlite", "asyncpg", "redis")}
    v["sqlite"] = __import__("sqlite3").sqlite_version
    v["tokenfleet"] = f"git {git_head()}"
    try:
        v["postgresql"] = subprocess.run(
            ["psql", "-At", "-c", "SHOW server_version", POSTGRES_ADMIN_URL], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        v["redis-server"] = redis.Redis.from_url(redis_url).info("server")["redis_version"]
    except Exception:  # noqa: BLE001 (informational only)
        pass
    return v


def _num(x: float | None, digits: int = 0) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def _pc(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%" + (" ⚠" if x > CONTENDED else "")


def write_report(path: Path, rep: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(rep, indent=1, default=str))
    m, a = rep["machine"], rep["args"]
    L = [
        f"# Usage metering — {rep['date']}",
        "",
        f"Command: `{rep['command']}`",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['memory']} RAM; Python {m['python']}; versions: "
        + ", ".join(f"{k} {v}" for k, v in rep["versions"].items() if v),
        "",
    ]
    if rep.get("pipeline"):
        L += pipeline_section(rep, a)
    if rep.get("lag"):
        L += lag_section(rep, a)
    contended = contention(rep)
    if contended:
        L += [
            "",
            f'**The machine was busy with other work** during {contended}: "other CPU" above '
            f"{100 * CONTENDED:.0f} % of the cores (other engineers' test suites). Rates are lower and latencies "
            "longer than on a quiet machine; treat them as lower bounds (rates) and upper bounds (latencies).",
        ]
    if rep.get("notes"):
        L += ["", "## Reading", ""] + [f"{n}\n" for n in rep["notes"]]
    L += ["", f"Method: the docstring of `bench/metering.py`. Run dir: `{rep['run_dir']}`.", ""]
    path.write_text("\n".join(L))
    print(f"wrote {path} and {path.with_suffix('.json')}")


def contention(rep: dict) -> str:
    """Which windows ran with other CPU load above CONTENDED, in words ("" when none)."""
    runs = [r for rows in rep.get("pipeline", {}).values() for row in rows for r in row["raw"]]
    windows = [(r.get("others_cpu") or 0) for r in runs]
    windows += [(r.get("others_cpu") or 0) for s in rep.get("lag", []) for r in s["rates"].values()]
    busy = [w for w in windows if w > CONTENDED]
    if not busy:
        return ""
    return f"{len(busy)} of {len(windows)} timed windows ({100 * min(busy):.0f}-{100 * max(busy):.0f} % of the cores)"


def pipeline_section(rep: dict, a: dict) -> list[str]:
    L = [
        "## Events per second through outbox → log → warehouse",
        "",
        f"{a['events']} events per run ({a['bulk_events']} for ship and warehouse"
        + (f", {a['sequential_events']} for the sequential recorder" if "sequential_events" in a else "")
        + f"; the floor and Outbox.close "
        f"with {a['writers']} concurrent writers), medians of {a['repeats']} runs (each on empty tables and an "
        'empty log), one Python process. "CPU/event" = CPU time per event of this process (SQLite included: it '
        "runs in the process) + of the servers (the PostgreSQL backends of the benchmark's connections and "
        "redis-server; a backend that exits during the run, i.e. a connection the pool closed, is not counted); "
        '"per CPU-second" = events per second of that CPU, a rate that does not depend on what else the machine '
        'runs. "Other CPU" = CPU used by processes that are not part of the benchmark, share of both cores, per '
        "run.",
        "",
        "| backend | stage | events/s (median) | runs | CPU/event µs (process + servers) | events per CPU-second | "
        "write p50 / p99 ms | lag p50 / p99 ms | connections opened | failed writes (retried) | other CPU |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for kind, rows in rep["pipeline"].items():
        for r in rows:
            write = f"{r['write_p50_ms']:.1f} / {r['write_p99_ms']:.1f}" if "write_p50_ms" in r else ""
            lag = f"{r['lag_p50_ms']:.0f} / {r['lag_p99_ms']:.0f}" if "lag_p50_ms" in r else ""
            failed = sum(r["write_errors"].values()) if "write_errors" in r else ""
            server = r.get("server_cpu_us_per_event") or 0
            cpu = _num(r["cpu_us_per_event"]) + (f" + {_num(server)}" if kind == "fleet" else "")
            L.append(
                f"| {BACKEND_LABELS[kind]} | {STAGE_LABELS.get(r['stage'], r['stage'])} | **{_num(r['per_s'])}** | "
                f"{', '.join(map(str, r['per_s_each']))} | {cpu} | {_num(1e6 / (r['cpu_us_per_event'] + server))}"
                f" | {write} | {lag} | {_num(r.get('connections_opened'))} | {failed} | "
                f"{', '.join(_pc(x) for x in r['others_cpu_each'])} |"
            )
    errors = sorted({e for rows in rep["pipeline"].values() for r in rows for e in r.get("write_errors", {})})
    if errors:
        L += ["", "Failed writes were: " + "; ".join(f"`{e}`" for e in errors) + "."]
    checks = [
        f"{BACKEND_LABELS[k]}: {'every run' if r.get('exact') else 'NOT every run'}"
        for k, rows in rep["pipeline"].items()
        for r in rows
        if r["stage"] == "end_to_end"
    ]
    if checks:
        L += [
            "",
            "End to end, `usage_events` held exactly the events written (count = distinct request ids = "
            "events): " + "; ".join(checks) + ".",
        ]
    return L + [""]


def lag_section(rep: dict, a: dict) -> list[str]:
    c = rep["checkpoint"]
    L = [
        "## Lag from request end to its warehouse row, under served load",
        "",
        f"bench/served_load.py's workload and client: per rate {a['lag_requests']} requests with Poisson arrivals "
        "(seed 0), prompts 16–512 tokens, max_tokens 8–256, streaming chat completions with ignore_eos, after its "
        f"8 warm-up requests; checkpoint `{c['dir']}` ({c['source']}, "
        f"{c['info'].get('parameters', 0) / 1e6:.1f}M parameters). Lag = `usage_events.created_at` (the writer's "
        "clock when it built the row, just before the insert) − `ended_at` (the gateway's clock when the request "
        "ended); both clocks are the same machine's.",
        "",
        "| system | rate req/s | requests | served req/s | rows | lag p50 ms | lag p99 ms | lag max ms | other CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in rep["lag"]:
        for rate, r in s["rates"].items():
            L.append(
                f"| {s['label']} | {rate} | {r['load']['requests']} | {r['load']['req_s']:.2f} | {r['rows']} | "
                f"{_num(r['lag_p50_ms'])} | {_num(r['lag_p99_ms'])} | {_num(r['lag_max_ms'])} | "
                f"{_pc(r['others_cpu'])} |"
            )
        o = s["overall"]
        L.append(
            f"| {s['label']} | all, with warm-up | {o['sent']} | | {o['rows']} | **{_num(o['lag_p50_ms'])}** | "
            f"**{_num(o['lag_p99_ms'])}** | {_num(o['lag_max_ms'])} | |"
        )
    L += ["", "Every request accounted for (warehouse rows matched to the client's x-request-id):", ""]
    for s in rep["lag"]:
        o = s["overall"]
        L.append(
            f"- {s['label']}: {o['sent']} requests sent, {o['rows']} rows (request_id is the table's key: "
            f"a second row for a request cannot exist); requests without a row {o['missing']}, rows of no "
            f"request sent {o['extra']}, one id given to two requests {o['doubled']}, responses without an id "
            f"{o['without_id']}; statuses "
            f"{o['statuses']}; output tokens {o['output_tokens_warehouse']} in the warehouse vs "
            f"{o['output_tokens_client']} reported to the client. Commands: "
            + "; ".join(f"`{cmd}`" for cmd in s["commands"])
            + "."
        )
    return L + [""]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--parts", default="pipeline,lag", help="pipeline,lag")
    p.add_argument("--backends", default="embedded,fleet", help="pipeline backends: embedded,fleet")
    p.add_argument("--stages", default=",".join(STAGES), help=f"pipeline stages, from {STAGES}")
    p.add_argument("--events", type=int, default=1000, help="events per run of the outbox and end-to-end stages")
    p.add_argument("--bulk-events", type=int, default=5000, help="events per run of the ship and warehouse stages")
    p.add_argument("--sequential-events", type=int, default=300, help="requests per run of the sequential stage")
    p.add_argument("--writers", type=int, default=4, help="concurrent writers of the floor and close-only stages")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--drain-timeout", type=float, default=120.0, help="longest wait for the warehouse to catch up")
    p.add_argument("--systems", default="serve,gateway", help="lag part: serve,gateway")
    p.add_argument("--lag-rates", default="4,16", help="served-load rates (req/s) for the lag part")
    p.add_argument("--lag-requests", type=int, default=40, help="requests per rate")
    p.add_argument("--model", help="HF checkpoint directory (default: served_load's demo checkpoint, --size)")
    p.add_argument("--size", choices=["small", "medium"], default="small")
    p.add_argument("--ckpt-root", default=os.path.join(tempfile.gettempdir(), "tokenfleet-bench", "served-checkpoints"))
    p.add_argument("--kv-cache-gib", type=float, default=0.5, help="KV cache per engine (the workload needs little)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--base-port", type=int, default=18700)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument(
        "--wait-idle",
        type=float,
        default=30.0,
        help="before each stage and system, wait up to this long for other work on the machine to stop",
    )
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    p.add_argument("--out", default="docs/benchmarks/metering.md", help="'' = no report files")
    p.add_argument("--run-dir", help="logs, databases and raw rows (default: a new temp dir)")
    p.add_argument("--note", action="append", default=[], help="a paragraph for the report's Reading section")
    p.add_argument("--rerender", metavar="JSON", help="rewrite the markdown from a previous run's JSON (+ --note)")
    args = p.parse_args(argv)
    args.parts = known_names(p, args.parts, ["pipeline", "lag"], "parts")
    args.backends = known_names(p, args.backends, ["embedded", "fleet"], "backends")
    args.stages = known_names(p, args.stages, STAGES, "stages")
    args.systems = known_names(p, args.systems, ["serve", "gateway"], "systems")
    args.lag_rates = [float(r) for r in args.lag_rates.split(",") if r.strip()]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rerender:
        rep, md = report_to_rerender(args)
        write_report(md, rep)
        return
    command = command_line(__file__)
    run_dir = make_run_dir(args.run_dir, "tokenfleet-metering-")
    rep: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "command": command,
        "machine": machine_info(args),
        "versions": versions(args.redis),
        "args": {k: v for k, v in vars(args).items() if k not in ("note", "rerender")},
        "run_dir": str(run_dir),
        "notes": list(args.note),
    }
    need_fleet = ("fleet" in args.backends and "pipeline" in args.parts) or (
        "gateway" in args.systems and "lag" in args.parts
    )
    backend, cleanup = fleet_backend(args, run_dir) if need_fleet else (None, lambda: None)
    try:
        if "pipeline" in args.parts:
            rep["pipeline"] = {
                kind: pipeline_part(backend if kind == "fleet" else Backend("embedded", run_dir), args)
                for kind in args.backends
            }
        if "lag" in args.parts:
            rep["lag"], rep["checkpoint"] = lag_part(args, backend, run_dir)
    finally:
        cleanup()
    if args.out:
        write_report(REPO / args.out if not os.path.isabs(args.out) else Path(args.out), rep)
    print(f"run dir: {run_dir}")


if __name__ == "__main__":
    main()
