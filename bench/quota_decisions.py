#!/usr/bin/env python3
"""Quota decisions per second: how many reserve + reconcile pairs one gateway process gets through against Redis,
and what latency a decision adds. Run by hand, never from the test suite:

    python bench/quota_decisions.py                       # 300 tenants, 1/16/64 pairs in flight, 3 x 5 s, medians
    python bench/quota_decisions.py --seconds 2 --repeats 1 --concurrency 1,64
    python bench/quota_decisions.py --rate 10000 --concurrency 64   # open loop: 10,000 pairs/s offered, <= 64 at once
    python bench/quota_decisions.py --kinds redis,leased              # Redis per decision, and with local leases

Workload: --tenants organisations with 10 users each; every pair picks a random (organisation, user), reserves
200-2000 tokens on both scopes (the "paid" tier's default limits: generous, so nearly every request is admitted and
the full charge path runs), then reconciles with a random 10-100 % of it. --concurrency such pairs run at once in
one asyncio process (one RedisQuota, a pool of --pool connections; "leased": a LeasedQuota on it, quota/leases.py,
which decides from leases of each scope's budget), each pair on a fresh turn of the event loop, as a request's
would be. Each run first does --warmup seconds of the same work, untimed (leases and connections there, as in a
gateway that has been running). Reported per run: pairs/s (one decision and
its settlement = two script calls), p50/p99 of the reserve and of the reconcile call, the server time per script
call (Redis INFO commandstats, evalsha), redis-server's CPU time per pair (from /proc: what caps one Redis core)
and the commands its scripts ran per pair (commandstats: each redis.call() costs server time, whatever it does;
both count every client of that Redis, so they read true only while the benchmark is its only client), the CPU time
this process spent per pair (the benchmark's own loop included: what caps one gateway core), script calls
per round trip to Redis (RedisQuota batches the calls of one event-loop tick), script calls Redis ran per pair (a
batch call counts once), the share of decisions made from a lease (leased), and "other CPU": machine CPU time
not used by this process or by redis-server during the window, as a share of all cores (other work on a shared
machine; above ~0.1, rerun).

Ceilings on the same machine, same concurrency:
  memory     MemoryQuota: the same decisions in process, no network (the cost of the quota code itself)
  redis-py   EVALSHA of a script that does nothing, same client, pool and concurrency (the client's ceiling)
  redis-benchmark   `redis-benchmark -q -n N -c 50 -t set,get` and `... evalsha <sha of "return 1"> 0`, when
             redis-benchmark is installed (the server's ceiling with a C client)
Keys use a unique prefix (tfbench:quota:<uuid>:) and are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
import redis.asyncio as aioredis
import redis.utils

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cpuprobe import _machine_busy_ticks, _tree_ticks  # noqa: E402

from tokenfleet.quota import Limits, MemoryQuota, RedisQuota, Scope  # noqa: E402
from tokenfleet.quota.leases import LeasedQuota  # noqa: E402

ORG, USER = Limits(6000, 2_000_000, 256, None), Limits(600, 200_000, 32, None)  # config.default_tiers()["paid"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Window:
    """Wall time, and CPU of the rest of the machine (not this process, not redis-server) over a timed window."""

    def __init__(self, redis_pid: int | None) -> None:
        self.redis_pid = redis_pid

    def _ticks(self) -> tuple[int, int, int]:
        server = _tree_ticks(self.redis_pid) if self.redis_pid else 0
        return _machine_busy_ticks(), _tree_ticks(os.getpid()) + server, server

    def __enter__(self) -> Window:
        self.t0, self.ticks0, self.cpu0 = time.perf_counter(), self._ticks(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.cpu0
        machine, mine, server = (b - a for a, b in zip(self.ticks0, self._ticks()))
        self.other_cpu = (machine - mine) / os.sysconf("SC_CLK_TCK") / (self.wall * os.cpu_count())
        self.server_cpu = server / os.sysconf("SC_CLK_TCK")  # redis-server's CPU seconds (all its clients')


async def pairs(quota, tenants: int, concurrency: int, seconds: float, seed: int, rate: float | None = None) -> dict:
    """Closed loop (rate None): `concurrency` workers, each starting its next pair when its last one ends. Open loop:
    pairs arrive at `rate` per second (Poisson), at most `concurrency` in flight; a reserve's latency counts from its
    scheduled arrival, so waiting for a free place (or for a late generator) is part of it."""
    rng = random.Random(seed)
    reserve_ms: list[float] = []
    reconcile_ms: list[float] = []
    refused = 0
    deadline = time.perf_counter() + seconds

    async def pair(name: str, start: float) -> None:
        nonlocal refused
        t, u = rng.randrange(tenants), rng.randrange(10)
        scopes = [Scope(f"org:t{t}", f"t{t}", ORG), Scope(f"user:t{t}/{u}", f"t{t}", USER)]
        tokens = rng.randint(200, 2000)
        decision = await quota.reserve(name, scopes, tokens, "paid")
        mid = time.perf_counter()
        reserve_ms.append((mid - start) * 1000)
        if not decision.allowed:
            refused += 1
            return
        await quota.reconcile(decision.reservation, int(tokens * rng.uniform(0.1, 1.0)))
        reconcile_ms.append((time.perf_counter() - mid) * 1000)

    async def worker(w: int) -> None:
        i = 0
        while time.perf_counter() < deadline:
            # a fresh turn of the loop per pair, as a request's reads give it: a decision made without waiting
            # (a lease's) would otherwise let one worker run pair after pair while the others wait
            await asyncio.sleep(0)
            await pair(f"w{w}-{i}-{seed}", time.perf_counter())
            i += 1

    async def arrivals() -> None:
        places = asyncio.Semaphore(concurrency)

        async def arrive(i: int, at: float) -> None:
            async with places:
                await pair(f"o{i}-{seed}", at)

        in_flight: set[asyncio.Task] = set()  # only these: thousands of finished ones kept would slow the collector
        at, i = time.perf_counter(), 0
        while at < deadline:
            at += rng.expovariate(rate)
            if (wait := at - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            task = asyncio.create_task(arrive(i, at))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            i += 1
        await asyncio.gather(*in_flight)

    if rate is None:
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    else:
        await arrivals()
    return {"decisions": len(reserve_ms), "refused": refused, "reserve_ms": reserve_ms, "reconcile_ms": reconcile_ms}


async def raw_evalsha(url: str, pool: int, concurrency: int, seconds: float) -> dict:
    client = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(url, max_connections=pool))
    sha = await client.script_load("return 1")
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            await client.evalsha(sha, 0)
            latencies.append((time.perf_counter() - start) * 1000)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.aclose()
    return {"decisions": len(latencies), "refused": 0, "reserve_ms": latencies, "reconcile_ms": []}


def evalsha_stats(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


def script_commands(client: redis.Redis) -> int:
    """Commands Redis has run but for script calls themselves (and INFO): the redis.call()s of the scripts, while
    nothing else uses this Redis."""
    stats = client.info("commandstats")
    skip = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_info")
    return sum(int(v.get("calls", 0)) for k, v in stats.items() if k not in skip)


def measure(
    kind: str,
    args: argparse.Namespace,
    concurrency: int,
    seed: int,
    sync: redis.Redis,
    redis_pid: int | None,
    prefix: str,
) -> dict:
    """One run; the window (wall, CPU, Redis's counters) covers the timed pairs only, after --warmup seconds of the
    same work on the same quota (untimed: leases taken, connections made, as in a gateway that has been running)."""
    window = Window(redis_pid)
    stats: dict[str, float] = {}

    async def timed(quota) -> dict:
        stats["calls0"], stats["usec0"] = evalsha_stats(sync)
        stats["commands0"] = script_commands(sync)
        batches0, local0 = _batches(quota), getattr(quota, "local_decisions", 0)
        with window:
            result = await pairs(quota, args.tenants, concurrency, args.seconds, seed, args.rate)
        stats["calls1"], stats["usec1"] = evalsha_stats(sync)
        stats["commands1"] = script_commands(sync)
        result["local"] = (getattr(quota, "local_decisions", 0) - local0) / max(1, result["decisions"])
        batches = _batches(quota) - batches0
        if batches:
            result["per_trip"] = (len(result["reserve_ms"]) + len(result["reconcile_ms"])) / batches
        return result

    async def go() -> dict:
        if kind == "redis-py":
            with window:
                result = await raw_evalsha(args.url, args.pool, concurrency, args.seconds)
            stats.update(calls0=0, usec0=0, commands0=0, calls1=0, usec1=0, commands1=0)
            return result
        if kind == "memory":
            quota = MemoryQuota()
        else:
            quota = RedisQuota.from_url(args.url, prefix, max_connections=args.pool)
            if kind == "leased":
                quota = LeasedQuota(quota)
        try:
            if args.warmup:
                await pairs(quota, args.tenants, concurrency, args.warmup, seed + 1000, args.rate)
            gc.collect()
            gc.freeze()  # as a gateway does once started (gateway/app.py): its heap out of the collector's sight
            return await timed(quota)
        finally:
            await quota.close()
            gc.unfreeze()

    result = asyncio.run(go())
    pairs_done = max(1, result["decisions"])
    redis_backed = kind in ("redis", "leased")
    calls = stats["calls1"] - stats["calls0"]
    result.update(
        kind=kind,
        concurrency=concurrency,
        wall=window.wall,
        cpu_us=window.cpu / pairs_done * 1e6,
        other_cpu=window.other_cpu,
        server_us=(stats["usec1"] - stats["usec0"]) / max(1, calls) if redis_backed else None,
        server_cpu_us=window.server_cpu / pairs_done * 1e6 if redis_backed else None,
        commands=(stats["commands1"] - stats["commands0"]) / pairs_done if redis_backed else None,
        script_calls=calls / pairs_done if redis_backed else None,
    )
    return result


def _batches(quota) -> int:
    """Round trips the quota's Redis store made so far (0: none, or no Redis)."""
    store = getattr(getattr(quota, "inner", quota), "store", None)
    batcher = getattr(store, "batcher", None)
    return batcher.batches if batcher is not None else 0


def summarize(runs: list[dict]) -> dict:
    med = statistics.median
    return {
        "kind": runs[0]["kind"],
        "concurrency": runs[0]["concurrency"],
        "runs": len(runs),
        "per_s": med(r["decisions"] / r["wall"] for r in runs),
        "refused": med(r["refused"] / max(1, r["decisions"]) for r in runs),
        "reserve_p50": med(percentile(r["reserve_ms"], 0.5) for r in runs),
        "reserve_p99": med(percentile(r["reserve_ms"], 0.99) for r in runs),
        "reconcile_p50": med(percentile(r["reconcile_ms"], 0.5) for r in runs) if runs[0]["reconcile_ms"] else None,
        "reconcile_p99": med(percentile(r["reconcile_ms"], 0.99) for r in runs) if runs[0]["reconcile_ms"] else None,
        "server_us": med(r["server_us"] for r in runs) if runs[0]["server_us"] is not None else None,
        "cpu_us": med(r["cpu_us"] for r in runs),
        "server_cpu_us": med(r["server_cpu_us"] for r in runs) if runs[0]["server_cpu_us"] is not None else None,
        "commands": med(r["commands"] for r in runs) if runs[0]["commands"] is not None else None,
        "per_trip": med(r["per_trip"] for r in runs) if "per_trip" in runs[0] else None,
        "script_calls": med(r["script_calls"] for r in runs) if runs[0].get("script_calls") is not None else None,
        "local": med(r.get("local", 0.0) for r in runs),
        "other_cpu": [round(r["other_cpu"], 2) for r in runs],
    }


def redis_benchmark(url: str, requests: int) -> list[str]:
    if not shutil.which("redis-benchmark"):
        return ["redis-benchmark not installed"]
    host_port = url.split("//", 1)[1].split("/", 1)[0]
    host, _, port = host_port.partition(":")
    base = ["redis-benchmark", "-h", host, "-p", port or "6379", "-q", "-n", str(requests), "-c", "50"]
    sha = redis.Redis.from_url(url).script_load("return 1")
    lines = []
    for extra in (["-t", "set,get"], ["evalsha", sha, "0"]):
        out = subprocess.run(base + extra, capture_output=True, text=True, timeout=300).stdout
        lines += [line.strip().split("\r")[-1] for line in out.splitlines() if "requests per second" in line]
    return lines


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(rows: list[dict]) -> None:
    print(
        "| backend | in flight | pairs/s (decision + reconcile) | reserve p50 / p99 ms | reconcile p50 / p99 ms "
        "| Redis time per script call | Redis CPU per pair | Redis commands per pair | CPU per pair (this process) "
        "| calls per round trip | script calls per pair | decided locally | refused | other CPU per run |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for s in rows:
        label = "redis-py EVALSHA `return 1` (calls/s)" if s["kind"] == "redis-py" else s["kind"]
        print(
            f"| {label} | {s['concurrency']} | {s['per_s']:.0f} | {fmt(s['reserve_p50'], '.2f')} / "
            f"{fmt(s['reserve_p99'], '.2f')} | {fmt(s['reconcile_p50'], '.2f')} / {fmt(s['reconcile_p99'], '.2f')} "
            f"| {fmt(s['server_us'], '.1f')} us | {fmt(s['server_cpu_us'], '.0f')} us | {fmt(s['commands'], '.1f')} "
            f"| {s['cpu_us']:.0f} us | {fmt(s['per_trip'], '.1f')} | {fmt(s['script_calls'], '.2f')} "
            f"| {s['local']:.0%} | {s['refused']:.1%} | {s['other_cpu']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="redis://127.0.0.1:6379")
    parser.add_argument("--tenants", type=int, default=300)
    parser.add_argument("--concurrency", default="1,16,64", help="pairs in flight, comma separated")
    parser.add_argument("--pool", type=int, default=16, help="Redis connections (RedisQuota.from_url default)")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--benchmark-requests", type=int, default=200_000)
    parser.add_argument("--warmup", type=float, default=1.0, help="untimed seconds of the same work first, per run")
    parser.add_argument(
        "--kinds",
        default="redis,leased,memory,redis-py",
        help="backends: redis (a decision per call), leased (local leases, quota/leases.py), memory, redis-py",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="open loop: pairs arrive at this rate (Poisson), --concurrency caps those in flight; the quota only",
    )
    args = parser.parse_args()

    sync = redis.Redis.from_url(args.url)
    redis_pid = int(sync.info("server").get("process_id", 0)) or None
    prefix = f"tfbench:quota:{uuid.uuid4().hex}:"
    rows = []
    try:
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            kinds = args.kinds.split(",")
            for kind in kinds if args.rate is None else [k for k in kinds if k != "redis-py"]:
                runs = [measure(kind, args, concurrency, seed, sync, redis_pid, prefix) for seed in range(args.repeats)]
                rows.append(summarize(runs))
                print(f"# {kind} x{concurrency}: {rows[-1]['per_s']:.0f}/s", file=sys.stderr, flush=True)
    finally:
        keys = list(sync.scan_iter(match=prefix + "*", count=5000))
        for i in range(0, len(keys), 1000):
            sync.delete(*keys[i : i + 1000])
    parser_name = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "pure-Python"
    print(
        f"python {sys.version.split()[0]}, redis-py {redis.__version__} ({parser_name} reply parser), redis-server "
        f"{sync.info('server')['redis_version']}, {os.cpu_count()} cores, {args.tenants} tenants x 10 users, "
        f"pool {args.pool}, {args.repeats} x {args.seconds:g} s per row (medians)"
        + (f"; open loop: {args.rate:g} pairs/s offered, 'in flight' is the cap" if args.rate else "")
        + "\n"
    )
    report(rows)
    print("\nredis-benchmark (-c 50, C client):")
    for line in redis_benchmark(args.url, args.benchmark_requests):
        print(f"    {line}")


if __name__ == "__main__":
    main()
