#!/usr/bin/env python3
"""Gateway capacity: what the gateway itself costs per streamed request, with no model behind it. Run by hand, never
from the test suite:

    python bench/gateway_capacity.py                  # every system; the table on stdout, raw rows (JSON) on stderr
    python bench/gateway_capacity.py --requests 600 --systems direct,gateway           # quick
    python bench/gateway_capacity.py --profile docs/benchmarks/gateway_profile.svg     # + a py-spy flame graph
    python bench/gateway_capacity.py --out notes.md   # also append the table to a file (the numbers and the reading
                                                      # of issue 25 are in docs/benchmarks/gateway_capacity.md)
    python bench/gateway_capacity.py --interleave before=/tmp/before,this=this --latency-requests 600
                                                      # added TTFT of two trees, lone requests in turn

The upstream is a fake OpenAI-compatible server (`python bench/gateway_capacity.py upstream --port P`, a bare ASGI
app on uvicorn with uvloop and httptools): every chat request streams --chunks content chunks at once, each with
continuous usage as our replicas send it, then the usage chunk and [DONE]; it answers GET /load and /health like a
tokenfleet replica. Side by side, one run, the same client and workload, --concurrency streamed chat requests in
flight (closed loop), --requests requests per system after --warmup:

  direct       the client against the upstream itself
  gateway      `tokenfleet gateway` in fleet mode with everything on: an API key (tenants in PostgreSQL), the Redis
               quota (a tier with generous limits on every dimension, so each request is reserved and reconciled),
               usage metering (outbox in PostgreSQL, the Redis Stream, the warehouse writer, all in the gateway
               process), the Redis resume buffer; one fake upstream as its replica
  workers2     the same with `--workers 2`
  litellm      LiteLLM's proxy with a master key (--litellm BIN, its `litellm` command; skipped when not given)

Per system: requests/s, CPU ms per request of the server process tree (utime + stime from /proc/PID/stat, from the
first timed request until the load ends and metering is written, less what the same processes burn idle over the
same time, measured just before), redis-server's CPU ms per request, TTFT p50/p99 (from sending the request to the
first content chunk) at --concurrency in flight, where a saturated server's TTFT is mostly queueing, and at one in
flight (--latency-requests sequential requests), where it is the path's own latency; the TTFT added over `direct`
is p50 minus p50 and p99 minus p99. "Other CPU" is the machine's CPU not used by the client, the servers of that
row or redis-server/PostgreSQL, as a share of all cores (bench/_cpuprobe.py; above 0.1 the machine was busy with
other work, and wall-clock figures suffer first).

Before/after comparisons: --tree DIR runs the gateways from another source tree (e.g. this one with some files as
they were at a commit: `git archive`), --hide-hiredis runs them without hiredis (redis-py's pure-Python parser, as
before hiredis was a dependency), --label names their rows.

Added TTFT, interleaved (--interleave LABEL=DIR,LABEL=DIR,...; `this` for this tree): the upstream direct and one
fleet gateway per tree run at once, and --latency-requests lone requests go to each in turn (request i to system
i mod n), so a machine whose load swings (a shared one) slows every system alike; per system TTFT p50/p90 and the
p50 added over direct. Nothing else is measured in this mode.

The client is a bare asyncio HTTP/1.1 client (keep-alive connections, chunked SSE read by hand), so it costs the
machine less than the servers it measures. The PostgreSQL database is a throwaway one (dropped at the end); Redis
keys live under a unique prefix (deleted at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]
from _cpuprobe import _machine_busy_ticks, _tree_ticks  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")
MODEL = "bench-model"
ADMIN_KEY = "bench-admin-" + uuid.uuid4().hex
MASTER_KEY = "sk-bench-" + uuid.uuid4().hex  # LiteLLM's
TIER = "bench"
# generous on every dimension: every request is admitted, and every dimension's script path runs
LIMITS = {
    "requests_per_minute": 10_000_000,
    "tokens_per_minute": 10_000_000_000,
    "concurrent_requests": 100_000,
    "tokens_per_day": 1_000_000_000_000,
}
PROMPT = "Say something about the sea, in twenty words or so."


# ----------------------------------------------------------------------------------------------------------------- #
# the fake upstream
# ----------------------------------------------------------------------------------------------------------------- #


def upstream_app(chunks: int):
    """A bare ASGI app: chat completions streamed at once, /load and /health as a tokenfleet replica has them."""
    load = json.dumps({"running": 0, "waiting": 0, "swapped": 0, "queued_prefill_tokens": 0, "kv_usage": 0.0}).encode()
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}).encode()
    created = int(time.time())
    counter = iter(range(1, 1 << 62))

    def event(data: dict) -> bytes:
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

    def stream(prompt_tokens: int, usage_each: bool) -> list[bytes]:
        rid = f"chatcmpl-{next(counter)}"
        out = []
        for i in range(chunks):
            delta = {"role": "assistant", "content": "word "} if i == 0 else {"content": "word "}
            finish = "length" if i == chunks - 1 else None
            chunk = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": MODEL,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            if usage_each:
                chunk["usage"] = usage(prompt_tokens, i + 1)
            out.append(event(chunk))
        usage_chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": MODEL}
        out.append(event({**usage_chunk, "choices": [], "usage": usage(prompt_tokens, chunks)}))
        out.append(b"data: [DONE]\n\n")
        return out

    def usage(prompt_tokens: int, completion: int) -> dict:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": 0},
            "engine_s": 0.0001 * completion,
        }

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] == "GET":
            body = load if path == "/load" else models if path == "/v1/models" else b"{}"
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": body})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(raw or b"{}")
        options = request.get("stream_options") or {}
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in request.get("messages", [])) + 8
        for piece in stream(prompt_tokens, bool(options.get("continuous_usage_stats"))):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


def serve_upstream(port: int, chunks: int) -> None:
    import uvicorn

    uvicorn.run(
        upstream_app(chunks),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


# ----------------------------------------------------------------------------------------------------------------- #
# the client
# ----------------------------------------------------------------------------------------------------------------- #


@dataclass
class Target:
    name: str
    port: int
    headers: dict[str, str] = field(default_factory=dict)


class Connection:
    """One keep-alive HTTP/1.1 connection that posts a streamed chat request and reads its SSE body by hand."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        body = json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True, "max_tokens": 20}
        ).encode()
        head = [
            "POST /v1/chat/completions HTTP/1.1",
            f"host: 127.0.0.1:{target.port}",
            "content-type: application/json",
            f"content-length: {len(body)}",
            "accept: text/event-stream",
        ]
        head += [f"{k}: {v}" for k, v in target.headers.items()]
        self.request = ("\r\n".join(head) + "\r\n\r\n").encode() + body

    async def chat(self) -> tuple[float, int]:
        """(seconds to the first content chunk, content chunks received)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.target.port)
        started = time.perf_counter()
        self.writer.write(self.request)
        status, headers = await self._head()
        if status != 200:
            body = await self._body(headers)
            raise RuntimeError(f"{self.target.name}: HTTP {status}: {body[:300]!r}")
        ttft, contents = None, 0
        async for data in self._events(headers):
            if b"word " in data:  # the upstream's content (however a server re-encodes the chunk's JSON)
                contents += 1
                if ttft is None:
                    ttft = time.perf_counter() - started
        if headers.get("connection") == "close":
            self.close()
        return (ttft if ttft is not None else float("nan")), contents

    async def _head(self) -> tuple[int, dict[str, str]]:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        return status, headers

    async def _body(self, headers: dict[str, str]) -> bytes:
        if "content-length" in headers:
            return await self.reader.readexactly(int(headers["content-length"]))
        return b"".join([piece async for piece in self._chunks()])

    async def _chunks(self):
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")
                return
            data = await self.reader.readexactly(size + 2)
            yield data[:-2]

    async def _events(self, headers: dict[str, str]):
        pending = b""
        source = self._chunks() if headers.get("transfer-encoding") == "chunked" else self._whole(headers)
        async for piece in source:
            pending += piece
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        yield line[5:]

    async def _whole(self, headers: dict[str, str]):
        yield await self._body(headers)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def load(target: Target, requests: int, concurrency: int, expected_chunks: int) -> tuple[list[float], float]:
    """Closed loop: `concurrency` connections, each sending its next request when the last one ended. (TTFTs, wall)."""
    ttfts: list[float] = []
    left = iter(range(requests))
    connections = [Connection(target) for _ in range(concurrency)]

    async def worker(connection: Connection) -> None:
        for _ in left:
            ttft, contents = await connection.chat()
            if contents != expected_chunks:
                raise RuntimeError(f"{target.name}: {contents} content chunks, expected {expected_chunks}")
            ttfts.append(ttft)

    started = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in connections))
    finally:
        for connection in connections:
            connection.close()
    return ttfts, time.perf_counter() - started


# ----------------------------------------------------------------------------------------------------------------- #
# servers
# ----------------------------------------------------------------------------------------------------------------- #


class Process:
    """A server subprocess in its own process group, with its log in the run dir."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env: dict | None = None, cwd=REPO) -> None:
        self.name, self.cmd, self.port, self.log = name, cmd, port, log
        self._logf = open(log, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._logf,
            stderr=subprocess.STDOUT,
            env=env or os.environ.copy(),
            cwd=cwd,
            start_new_session=True,
        )

    def wait_ready(self, path: str, timeout: float = 120.0, headers: dict | None = None) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited (rc={self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}{path}", timeout=2, headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._logf.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Services:
    redis_url: str
    redis_pid: int | None
    postgres_admin_url: str
    prefix: str
    database: str = ""

    @property
    def database_url(self) -> str:
        return self.postgres_admin_url.rsplit("/", 1)[0] + "/" + self.database


def postgres_admin(url: str, sql: str) -> None:
    import asyncpg

    async def go() -> None:
        conn = await asyncpg.connect(url, timeout=5)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(go())


def postgres_pids(services: Services) -> list[int]:
    """The PostgreSQL backends serving the benchmark's database (the gateway's connections)."""
    import asyncpg

    async def go() -> list[int]:
        conn = await asyncpg.connect(services.postgres_admin_url, timeout=5)
        try:
            rows = await conn.fetch("SELECT pid FROM pg_stat_activity WHERE datname = $1", services.database)
        finally:
            await conn.close()
        return [r["pid"] for r in rows]

    try:
        return asyncio.run(go())
    except Exception:
        return []


def fleet_file(path: Path, model_dir: Path, port: int, upstream_port: int, services: Services) -> None:
    fleet = {
        "model_name": MODEL,
        "model_path": str(model_dir),
        "host": "127.0.0.1",
        "port": port,
        "replicas": [f"http://127.0.0.1:{upstream_port}"],
        "redis_url": services.redis_url,
        "redis_prefix": services.prefix + "stream:",
        "database_url": services.database_url,
        "admin_key": ADMIN_KEY,
        "tiers": {TIER: {"priority": 0, "weight": 8, "user_limits": LIMITS, "org_limits": LIMITS}},
        "dispatch": {"slots_per_replica": 1024},
        "quota": {"prefix": services.prefix + "quota:", "backend": "redis"},
        "metering": {"stream_key": services.prefix + "usage"},
        "autoscale": {"enabled": False},
    }
    path.write_text(json.dumps(fleet, indent=1) + "\n")


def api_key(port: int) -> str:
    import httpx

    r = httpx.post(
        f"http://127.0.0.1:{port}/admin/v1/keys",
        json={"org": "bench-org", "user": "bench-user", "tier": TIER},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    )
    r.raise_for_status()
    return r.json()["key"]


def litellm_config(path: Path, upstream_port: int) -> None:
    config = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": f"http://127.0.0.1:{upstream_port}/v1",
                    "api_key": "x",
                },
            }
        ],
        "general_settings": {"master_key": MASTER_KEY},
    }
    path.write_text(json.dumps(config, indent=1) + "\n")  # JSON is YAML


# ----------------------------------------------------------------------------------------------------------------- #
# measuring
# ----------------------------------------------------------------------------------------------------------------- #


def ticks(pids: list[int]) -> int:
    return sum(_tree_ticks(p) for p in pids)


def single_ticks(pid: int | None) -> int:
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[11]) + int(rest[12])
    except OSError:
        return 0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(v for v in values if v == v)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def usage_rows(services: Services) -> int:
    import asyncpg

    conn = await asyncpg.connect(services.database_url, timeout=5)
    try:
        return await conn.fetchval("SELECT count(*) FROM usage_events")
    finally:
        await conn.close()


def measure(name: str, target: Target, pids: list[int], args, services: Services, metered: bool) -> dict:
    """Warm-up, idle CPU, then the timed load (and, for a metered gateway, until its usage rows are written)."""
    asyncio.run(load(target, args.warmup, args.concurrency, args.chunks))
    settle_rows = asyncio.run(usage_rows(services)) + args.requests if metered else 0
    time.sleep(1.0)
    idle0, idle_t0 = ticks(pids), time.perf_counter()
    time.sleep(args.idle_s)
    idle_rate = (ticks(pids) - idle0) / HZ / (time.perf_counter() - idle_t0)  # CPU s per s, idle

    db_pids = postgres_pids(services) if metered else []
    machine0, own0 = _machine_busy_ticks(), ticks(pids) + single_ticks(services.redis_pid) + ticks(db_pids)
    redis0, server0, client0 = single_ticks(services.redis_pid), ticks(pids), time.process_time()
    t0 = time.perf_counter()
    ttfts, wall = asyncio.run(load(target, args.requests, args.concurrency, args.chunks))
    if metered:  # the gateway's deferred work (outbox, shipping, the warehouse) is part of a request's cost
        deadline = time.monotonic() + 30
        while asyncio.run(usage_rows(services)) < settle_rows and time.monotonic() < deadline:
            time.sleep(0.1)
    span = time.perf_counter() - t0
    server_s = (ticks(pids) - server0) / HZ
    redis_s = (single_ticks(services.redis_pid) - redis0) / HZ
    client_s = time.process_time() - client0
    machine = _machine_busy_ticks() - machine0
    own = ticks(pids) + single_ticks(services.redis_pid) + ticks(db_pids) - own0
    other = (machine - own) / HZ - client_s
    n = len(ttfts)
    lone, _ = asyncio.run(load(target, args.latency_requests, 1, args.chunks))
    return {
        "system": name,
        "requests": n,
        "rps": n / wall,
        "cpu_ms": max(0.0, server_s - idle_rate * span) / n * 1000,
        "cpu_ms_gross": server_s / n * 1000,
        "idle_cpu": idle_rate,
        "redis_ms": redis_s / n * 1000,
        "client_ms": client_s / n * 1000,
        "ttft_p50": pct(ttfts, 0.5) * 1000,
        "ttft_p99": pct(ttfts, 0.99) * 1000,
        "lone_p50": pct(lone, 0.5) * 1000,
        "lone_p99": pct(lone, 0.99) * 1000,
        "other_cpu": other / (span * (os.cpu_count() or 1)),
        "settle_s": span - wall,
    }


def profile(pid: int, out: Path, target: Target, args) -> None:
    """py-spy record of the gateway (and its workers) while the same load runs again."""
    spy = shutil.which("py-spy")
    if spy is None:
        print("# py-spy not installed (pip install py-spy): no profile", file=sys.stderr)
        return
    seconds = max(5, int(args.profile_s))
    kind = "raw" if out.suffix == ".txt" else "flamegraph"  # raw: collapsed stacks, one line each, to read by script
    cmd = [
        spy,
        "record",
        "-o",
        str(out),
        "--pid",
        str(pid),
        "--duration",
        str(seconds),
        "--rate",
        "250",
        "--subprocesses",
        "--nonblocking",
        "--format",
        kind,
    ]
    spy_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)
    deadline = time.monotonic() + seconds

    async def until_deadline() -> None:
        while time.monotonic() < deadline:
            await load(target, args.concurrency * 10, args.concurrency, args.chunks)

    asyncio.run(until_deadline())
    _, err = spy_proc.communicate(timeout=120)
    print(f"# profile: {out} ({err.decode(errors='replace').strip().splitlines()[-1:]})", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------------------- #
# the run
# ----------------------------------------------------------------------------------------------------------------- #


def run(args) -> list[dict]:
    import redis

    from tokenfleet.model.demo import write_demo_checkpoint

    run_dir = Path(tempfile.mkdtemp(prefix="gateway-capacity-"))
    model_dir = write_demo_checkpoint(run_dir / "model", size="tiny", seed=0)
    sync = redis.Redis.from_url(args.redis)
    services = Services(
        args.redis,
        int(sync.info("server").get("process_id", 0)) or None,
        args.postgres,
        f"tfbench:gwcap:{uuid.uuid4().hex}:",
    )
    rows: list[dict] = []
    upstream_port = free_port()
    upstream = Process(
        "upstream",
        [sys.executable, __file__, "upstream", "--port", str(upstream_port), "--chunks", str(args.chunks)],
        upstream_port,
        run_dir / "upstream.log",
    )
    try:
        upstream.wait_ready("/health")
        if "direct" in args.systems:
            rows.append(measure("direct", Target("direct", upstream_port), [upstream.proc.pid], args, services, False))
            print(f"# {rows[-1]}", file=sys.stderr, flush=True)
        for system in ("gateway", "workers2"):
            if system in args.systems:
                rows.append(run_gateway(system, args, run_dir, model_dir, upstream_port, services))
                print(f"# {rows[-1]}", file=sys.stderr, flush=True)
        if "litellm" in args.systems and args.litellm:
            rows.append(run_litellm(args, run_dir, upstream_port, services))
            print(f"# {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        upstream.stop()
        keys = list(sync.scan_iter(match=services.prefix + "*", count=5000))
        for i in range(0, len(keys), 1000):
            sync.delete(*keys[i : i + 1000])
        print(f"# logs in {run_dir}", file=sys.stderr)
    return rows


def gateway_env(args, run_dir: Path, tree: str | None = None) -> dict:
    """The environment of a gateway process: the source tree under test, hiredis hidden when asked."""
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENFLEET_ADMIN_KEY", "TOKENFLEET_DATABASE_URL")}
    tree = args.tree if tree is None else tree
    paths = [str(Path(tree).resolve())] if tree else []
    if args.hide_hiredis:
        shim = run_dir / "no-hiredis"
        shim.mkdir(exist_ok=True)
        (shim / "hiredis.py").write_text('raise ImportError("hiredis hidden by bench/gateway_capacity.py")\n')
        paths.insert(0, str(shim))
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_gateway(system: str, args, run_dir: Path, model_dir: Path, upstream_port: int, services: Services) -> dict:
    services.database = f"tfbench_{uuid.uuid4().hex}"
    postgres_admin(services.postgres_admin_url, f'CREATE DATABASE "{services.database}"')
    port = free_port()
    config = run_dir / f"fleet-{system}.json"
    fleet_file(config, model_dir, port, upstream_port, services)
    cmd = [sys.executable, "-m", "tokenfleet", "gateway", "--config", str(config)]
    if system == "workers2":
        cmd += ["--workers", "2"]
    name = f"{system}{args.label}"
    gateway = Process(name, cmd, port, run_dir / f"{system}.log", gateway_env(args, run_dir), cwd=args.tree or REPO)
    try:
        gateway.wait_ready("/health")
        target = Target(name, port, {"authorization": f"Bearer {api_key(port)}"})
        row = measure(name, target, [gateway.proc.pid], args, services, True)
        if args.profile and system == "gateway":
            profile(gateway.proc.pid, Path(args.profile), target, args)
        return row
    finally:
        gateway.stop()
        postgres_admin(services.postgres_admin_url, f'DROP DATABASE IF EXISTS "{services.database}" WITH (FORCE)')


def run_interleaved(args) -> list[dict]:
    """Lone requests to the upstream and to one gateway per tree, in turn (see the module's docstring)."""
    import redis

    from tokenfleet.model.demo import write_demo_checkpoint

    run_dir = Path(tempfile.mkdtemp(prefix="gateway-interleaved-"))
    model_dir = write_demo_checkpoint(run_dir / "model", size="tiny", seed=0)
    sync = redis.Redis.from_url(args.redis)
    prefix = f"tfbench:gwcap:{uuid.uuid4().hex}:"
    upstream_port = free_port()
    upstream = Process(
        "upstream",
        [sys.executable, __file__, "upstream", "--port", str(upstream_port), "--chunks", str(args.chunks)],
        upstream_port,
        run_dir / "upstream.log",
    )
    gateways: list[tuple[Process, Services]] = []
    try:
        upstream.wait_ready("/health")
        targets = [Target("direct", upstream_port)]
        for spec in args.interleave.split(","):
            label, tree = spec.split("=", 1)
            tree = "" if tree == "this" else tree
            services = Services(args.redis, None, args.postgres, f"{prefix}{label}:", f"tfbench_{uuid.uuid4().hex}")
            postgres_admin(services.postgres_admin_url, f'CREATE DATABASE "{services.database}"')
            port = free_port()
            fleet_file(run_dir / f"fleet-{label}.json", model_dir, port, upstream_port, services)
            cmd = [sys.executable, "-m", "tokenfleet", "gateway", "--config", str(run_dir / f"fleet-{label}.json")]
            env = gateway_env(args, run_dir, tree)
            gateway = Process(label, cmd, port, run_dir / f"{label}.log", env, cwd=tree or REPO)
            gateways.append((gateway, services))
            gateway.wait_ready("/health")
            targets.append(Target(label, port, {"authorization": f"Bearer {api_key(port)}"}))
        ttfts = asyncio.run(_in_turn(targets, args.warmup, args.latency_requests))
    finally:
        for gateway, services in gateways:
            gateway.stop()
            postgres_admin(services.postgres_admin_url, f'DROP DATABASE IF EXISTS "{services.database}" WITH (FORCE)')
        upstream.stop()
        keys = list(sync.scan_iter(match=prefix + "*", count=5000))
        for i in range(0, len(keys), 1000):
            sync.delete(*keys[i : i + 1000])
    direct = pct(ttfts["direct"], 0.5)
    return [
        {"system": name, "p50": pct(v, 0.5) * 1000, "p90": pct(v, 0.9) * 1000, "added": (pct(v, 0.5) - direct) * 1000}
        for name, v in ttfts.items()
    ]


async def _in_turn(targets: list[Target], warmup: int, requests: int) -> dict[str, list[float]]:
    connections = [Connection(t) for t in targets]
    ttfts: dict[str, list[float]] = {t.name: [] for t in targets}
    try:
        for i in range((warmup + requests) * len(connections)):
            connection = connections[i % len(connections)]
            ttft, _ = await connection.chat()
            if i >= warmup * len(connections):
                ttfts[connection.target.name].append(ttft)
    finally:
        for connection in connections:
            connection.close()
    return ttfts


def run_litellm(args, run_dir: Path, upstream_port: int, services: Services) -> dict:
    port = free_port()
    config = run_dir / "litellm.yaml"
    litellm_config(config, upstream_port)
    env = {**os.environ, "LITELLM_LOG": "ERROR"}
    proxy = Process(
        "litellm", [args.litellm, "--config", str(config), "--port", str(port)], port, run_dir / "litellm.log", env
    )
    try:
        proxy.wait_ready("/health/liveliness", timeout=240)
        target = Target("litellm", port, {"authorization": f"Bearer {MASTER_KEY}"})
        return measure("litellm", target, [proxy.proc.pid], args, services, False)
    finally:
        proxy.stop()


def report(rows: list[dict]) -> str:
    direct = next((r for r in rows if r["system"] == "direct"), None)

    def added(r: dict, p50: str, p99: str) -> str:
        if direct is None or r is direct:
            return "-"
        return f"{r[p50] - direct[p50]:.2f} / {r[p99] - direct[p99]:.2f}"

    lines = [
        "| system | requests/s | CPU ms per request (server processes) | idle CPU (cores) | redis-server CPU ms "
        "per request | TTFT p50 / p99 ms, all in flight | added | TTFT p50 / p99 ms, 1 in flight | added "
        "| client CPU ms per request | other CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['rps']:.0f} | {r['cpu_ms']:.2f} (gross {r['cpu_ms_gross']:.2f}) "
            f"| {r['idle_cpu']:.3f} | {r['redis_ms']:.3f} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} "
            f"| {added(r, 'ttft_p50', 'ttft_p99')} | {r['lone_p50']:.2f} / {r['lone_p99']:.2f} "
            f"| {added(r, 'lone_p50', 'lone_p99')} | {r['client_ms']:.2f} | {r['other_cpu']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    up = sub.add_parser("upstream", help="run the fake upstream only")
    up.add_argument("--port", type=int, required=True)
    up.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--systems", default="direct,gateway,workers2,litellm")
    parser.add_argument("--requests", type=int, default=3000, help="timed requests per system")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--idle-s", type=float, default=3.0, help="idle CPU measured this long before the load")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--postgres",
        default=os.environ.get("TOKENFLEET_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"),
    )
    parser.add_argument("--litellm", default=shutil.which("litellm"), help="LiteLLM's `litellm` command")
    parser.add_argument("--profile", default="", help="write a py-spy flame graph (SVG) of the gateway here")
    parser.add_argument("--profile-s", type=float, default=20.0)
    parser.add_argument("--latency-requests", type=int, default=200, help="sequential requests for TTFT at 1 in flight")
    parser.add_argument("--tree", default="", help="run the gateways from this source tree (default: this one)")
    parser.add_argument("--hide-hiredis", action="store_true", help="run the gateways without hiredis")
    parser.add_argument("--label", default="", help="appended to the gateway rows' names, e.g. ' (before)'")
    parser.add_argument("--out", default="", help="append the table to this markdown file ('' prints only)")
    parser.add_argument("--interleave", default="", help="LABEL=DIR,...: lone-request TTFT, interleaved (only)")
    args = parser.parse_args()
    if args.command == "upstream":
        serve_upstream(args.port, args.chunks)
        return
    if args.interleave:
        interleaved(args)
        return
    args.systems = args.systems.split(",")
    load_before = os.getloadavg()
    rows = run(args)
    load_after = os.getloadavg()
    table = report(rows)
    head = (
        f"python {sys.version.split()[0]}, {os.cpu_count()} cores, {args.concurrency} streamed chat requests in flight, "
        f"{args.chunks} chunks each, {args.requests} timed requests per system after {args.warmup} warm-up; "
        f"load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
        f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}"
    )
    print(head + "\n\n" + table)
    if args.out:
        with Path(args.out).open("a") as out:
            out.write(head + "\n\n" + table + "\n\n")
    print(json.dumps(rows, indent=1), file=sys.stderr)


def interleaved(args) -> None:
    load_before = os.getloadavg()
    rows = run_interleaved(args)
    load_after = os.getloadavg()
    lines = [
        f"python {sys.version.split()[0]}, {os.cpu_count()} cores, {args.latency_requests} lone streamed chat requests "
        f"per system after {args.warmup} warm-up, in turn; load average (1/5/15 min) before "
        f"{load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, after "
        f"{load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}",
        "",
        "| system | TTFT p50 / p90 ms, 1 in flight | added TTFT p50 ms |",
        "|---|---:|---:|",
    ]
    lines += [f"| {r['system']} | {r['p50']:.2f} / {r['p90']:.2f} | {r['added']:.2f} |" for r in rows]
    print("\n".join(lines))
    if args.out:
        with Path(args.out).open("a") as out:
            out.write("\n".join(lines) + "\n\n")
    print(json.dumps(rows, indent=1), file=sys.stderr)


if __name__ == "__main__":
    main()
