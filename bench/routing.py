#!/usr/bin/env python3
"""Fleet routing benchmark: round-robin vs. least-loaded vs. cache-aware routing on a multi-turn chat workload, over
real replica processes behind a real gateway, against one replica holding the whole fleet's KV cache.

Run by hand, never from the test suite:

    python bench/routing.py --conversations 8 --concurrency 8 --out ''  # quick check (no report written)
    python bench/routing.py                                             # report: docs/benchmarks/routing.md + .json
    python bench/routing.py --rerender docs/benchmarks/routing.json --note "..."   # add notes, rewrite the markdown

Runs (--runs, comma separated, in this order), each at every --concurrency (comma separated, default 8,64):
  baseline            ONE replica with --replicas x --kv-cache-gib of KV cache (the fleet's combined cache) behind the
                      gateway: the hit rate one replica holding everything gets on this workload, the ideal.
  round_robin         --replicas replicas, each with --kv-cache-gib, gateway `routing.policy: round_robin`.
  least_loaded        the same, `routing.policy: least_loaded`.
  cache_aware         the same, `routing.policy: cache_aware` (prefix index, conversation homes and the load bound:
                      `load_bound`, `load_slack`).
  cache_aware_noaff   cache_aware without the `x-conversation-id` header (the router has only the prompt to go on).
Default: all but cache_aware_noaff.  Every run starts its replicas and its gateway fresh (cold caches, empty prefix
index), warms each replica with two short requests of its own (unrelated text: kernels, tokenizer), then one short
request through the gateway, then runs the workload.  Replicas and gateway are stopped (SIGTERM to their process
group, SIGKILL after 10 s) before the next run.  Processes: `python -m tokenfleet replica --model DIR --port P
--kv-cache-gib X --max-model-len 2048` and `python -m tokenfleet gateway --config fleet.yaml` (SQLite tenants, an
in-memory quota and resume buffer, one tier "bench" without limits, the overload ladder's TTFT target set to 1 h so it
never sheds or queues: this measures routing, not admission control), OMP/MKL threads = --threads per process.

Workload (seeded, identical for every run), --trace:
  mixed (default; issue 26's shape)  --conversations multi-turn conversations, each on one of --system-prompts shared
        system prompts (--system-tokens MIN,MAX tokens each) chosen with uneven popularity (prompt i with weight
        1/(i+1)); a --document-share of them open with one of --documents shared documents (--document-tokens
        MIN,MAX) before their first question; [--turns-min, --turns-max] turns of [--user-min, --user-max] tokens
        each; plus one-off prompts (--one-off-share of all sessions: one turn, no system prompt, --one-off-tokens
        MIN,MAX tokens, no x-conversation-id); max_tokens uniform in --max-tokens MIN,MAX per request.
  chat  the earlier uniform trace: every conversation on one of --system-prompts prompts chosen uniformly, no
        documents, no one-offs, --system-tokens MAX tokens each, max_tokens MAX for every request.
Each turn sends the whole history: system prompt, every earlier user message and the assistant's replies AS THE
SERVER RETURNED THEM, then the new user message; ignore_eos, temperature 0, streaming with
stream_options.include_usage, header `x-conversation-id: conv-N` for conversations (not in cache_aware_noaff).
--concurrency sessions are in flight at once (a worker takes the next session when one ends; a conversation's turns
are sequential, with no think time), so at most that many requests are.

Metrics, per run:
  hit rate      sum of usage.prompt_tokens_details.cached_tokens / sum of usage.prompt_tokens over every request of
                the workload (from the responses); also the replicas' own vllm:prefix_cache_hits / queries.
  % of ideal    hit rate / the baseline's at the same concurrency (target: >= 95 %).
  TTFT          send -> first chunk with non-empty delta.content, p50 / p99 over every request (ms); target for
                cache_aware: p50 below round_robin's.
  load          per replica, deltas of /metrics over the workload: requests served (vllm:request_success_total),
                prompt tokens computed (vllm:prompt_tokens_total - vllm:prefix_cache_hits_total: the prefill work
                the cache did not save), and "busy" = /load's running + waiting sampled every --sample-s (time
                integral).  Imbalance = max / mean over the replicas (target for requests: <= 1.25).
  routes        the gateway's `route ... reason=... skipped=...` log lines of the workload: why each replica was
                chosen (affinity / prefix / new / least_loaded / round_robin) and how often the load bound passed
                over a preferred replica.
  other CPU     CPU used by processes outside this benchmark's tree during the workload, share of all cores
                (bench/_cpuprobe.py; above 10 %: contended, latencies unreliable).

Output: a markdown report (--out, default docs/benchmarks/routing.md) and a JSON next to it; replica and gateway
logs, the fleet files, the workload and the raw per-request records stay in the run directory (printed at the end).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import os
import platform
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402  (stdlib only)
    CONTENDED,
    REPO,
    WORDS,
    ChatStream,
    bench_parser,
    command_line,
    cpu_model,
    given_checkpoint,
    make_run_dir,
    memory_total,
    package_versions,
    pct,
    prompt_text,
    report_to_rerender,
    thread_env,
)
from _cpuprobe import CpuProbe  # noqa: E402  (stdlib only)

ALL_RUNS = ["baseline", "round_robin", "least_loaded", "cache_aware", "cache_aware_noaff"]
DEFAULT_RUNS = ALL_RUNS[:4]
TRACES = ("mixed", "chat")
KV_CACHE_GIB = {"mixed": 0.0625, "chat": 0.0125}  # per replica, by trace: see --kv-cache-gib
POLICY = {
    "baseline": "cache_aware",
    "round_robin": "round_robin",
    "least_loaded": "least_loaded",
    "cache_aware": "cache_aware",
    "cache_aware_noaff": "cache_aware",
}
LABELS = {
    "baseline": "single replica, combined cache (baseline)",
    "round_robin": "round_robin",
    "least_loaded": "least_loaded",
    "cache_aware": "cache_aware",
    "cache_aware_noaff": "cache_aware, no x-conversation-id",
}
SERVED = "demo"
TIER = "bench"
HIT_TARGET, IMBALANCE_TARGET = 0.95, 1.25


# ----------------------------------------------------------------------------------------------------------------- #
# checkpoint and workload
# ----------------------------------------------------------------------------------------------------------------- #


def ensure_checkpoint(args) -> tuple[Path, str]:
    if args.model:
        return given_checkpoint(args.model)
    d = Path(args.ckpt_root) / f"demo-{args.size}"
    if not (d / "model.safetensors").exists() or not (d / "tokenizer.json").exists():
        subprocess.run(
            [sys.executable, "-m", "tokenfleet", "demo-model", str(d), "--size", args.size],
            check=True,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
    return d, f"`python -m tokenfleet demo-model DIR --size {args.size}` (random weights)"


def checkpoint_info(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "torch_dtype",
    )
    info = {k: cfg.get(k) for k in keys}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(cfg.get("torch_dtype") or "float32", 4)
    # K and V, every layer, every KV head: what one token costs in the paged cache
    info["kv_bytes_per_token"] = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    return info


def make_workload(args, model_dir: Path) -> dict:
    """Sessions in the order workers take them: {"id" (None for a one-off), "system" and "document" (indexes or
    None), "users" (one message per turn), "max_tokens" (one per turn)}."""
    from tokenizers import Tokenizer  # light (no torch)

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(f"routing/{args.trace}/{args.seed}")  # str seeds are deterministic
    make = mixed_sessions if args.trace == "mixed" else chat_sessions
    systems, documents, sessions = make(args, rng, lambda n: prompt_text(rng, tok, n))
    return {"seed": args.seed, "trace": args.trace, "systems": systems, "documents": documents, "sessions": sessions}


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    return int(low), int(high or low)


def mixed_sessions(args, rng: random.Random, text) -> tuple[list[str], list[str], list[dict]]:
    """Issue 26's trace: conversations over shared system prompts of uneven popularity, some opening with a shared
    document, and one-off prompts among them."""
    systems = [
        f"You are assistant number {i}. " + text(rng.randint(*_range(args.system_tokens)))
        for i in range(args.system_prompts)
    ]
    documents = [f"Document {i}:\n" + text(rng.randint(*_range(args.document_tokens))) for i in range(args.documents)]
    popularity = [1 / (i + 1) for i in range(args.system_prompts)]
    low, high = _range(args.max_tokens)
    sessions = []
    for c in range(args.conversations):
        turns = rng.randint(args.turns_min, args.turns_max)
        sessions.append(
            {
                "name": f"conv-{c}",
                "id": f"conv-{c}",
                "system": rng.choices(range(args.system_prompts), popularity)[0],
                "document": _document(args, rng),
                "users": [text(rng.randint(args.user_min, args.user_max)) for _ in range(turns)],
                "max_tokens": [rng.randint(low, high) for _ in range(turns)],
            }
        )
    one_offs = round(args.conversations * args.one_off_share / (1 - args.one_off_share))
    for k in range(one_offs):
        prompt = text(rng.randint(*_range(args.one_off_tokens)))
        one = {"name": f"one-off-{k}", "id": None, "system": None, "document": None, "users": [prompt]}
        sessions.append(one | {"max_tokens": [rng.randint(low, high)]})
    rng.shuffle(sessions)
    return systems, documents, sessions


def _document(args, rng: random.Random) -> int | None:
    """The shared document a conversation opens with, if it opens with one."""
    return rng.randrange(args.documents) if args.documents and rng.random() < args.document_share else None


def chat_sessions(args, rng: random.Random, text) -> tuple[list[str], list[str], list[dict]]:
    """The earlier uniform trace: every conversation on one of the system prompts, chosen uniformly."""
    system_tokens, max_tokens = _range(args.system_tokens)[1], _range(args.max_tokens)[1]
    systems = [f"You are assistant number {i}. " + text(system_tokens) for i in range(args.system_prompts)]
    sessions = []
    for c in range(args.conversations):
        turns = rng.randint(args.turns_min, args.turns_max)
        sessions.append(
            {
                "name": f"conv-{c}",
                "id": f"conv-{c}",
                "system": rng.randrange(args.system_prompts),
                "document": None,
                "users": [text(rng.randint(args.user_min, args.user_max)) for _ in range(turns)],
                "max_tokens": [max_tokens] * turns,
            }
        )
    return systems, [], sessions


# ----------------------------------------------------------------------------------------------------------------- #
# processes
# ----------------------------------------------------------------------------------------------------------------- #


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
    )


def stop(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def wait_healthy(httpx, url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{url}: process exited with {proc.returncode}; see {log}:\n" + log.read_text(errors="replace")[-2000:]
            )
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f}s; see {log}")


def scrape(httpx, url: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}."""
    sums: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        sums[name] = sums.get(name, 0.0) + value
    return sums


# ----------------------------------------------------------------------------------------------------------------- #
# client
# ----------------------------------------------------------------------------------------------------------------- #


async def stream_turn(client, url: str, headers: dict, body: dict, timeout: float) -> dict:
    stream, err = ChatStream(), None
    send = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body, headers=headers) as r:
                err = await stream.read(r)
    except TimeoutError:
        err = f"timed out after {timeout:.0f}s"
    except Exception as e:  # noqa: BLE001  (connection errors etc.: the request failed)
        err = f"{e.__class__.__name__}: {e}"[:300]
    end = time.perf_counter()
    first, usage = stream.first_content_at, stream.usage or {}
    rec = {
        "send": send,
        "end": end,
        "ttft": None if first is None else first - send,
        "finish": stream.finish,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "text": "".join(piece for _, piece in stream.content),
    }
    if err is None and (first is None or usage.get("prompt_tokens") is None):
        err = "no content chunk" if first is None else "no usage in the stream"
    rec["error"] = err
    return rec


def first_messages(wl: dict, session: dict) -> list[dict]:
    """The session's system prompt, if it has one."""
    return [] if session["system"] is None else [{"role": "system", "content": wl["systems"][session["system"]]}]


def user_message(wl: dict, session: dict, turn: int) -> dict:
    """The turn's user message; a conversation with a document opens with it."""
    document = session["document"]
    opening = f"{wl['documents'][document]}\n\n" if document is not None and turn == 0 else ""
    return {"role": "user", "content": opening + session["users"][turn]}


async def run_workload(
    httpx, base: str, key: str, wl: dict, args, affinity: bool, concurrency: int
) -> tuple[list[dict], float]:
    url = f"{base}/v1/chat/completions"
    queue: asyncio.Queue = asyncio.Queue()
    for session in wl["sessions"]:
        queue.put_nowait(session)
    records: list[dict] = []
    t0 = time.perf_counter()

    async def conversation(client, session: dict) -> None:
        messages = first_messages(wl, session)
        headers = {"Authorization": f"Bearer {key}"}
        if affinity and session["id"] is not None:
            headers["x-conversation-id"] = session["id"]
        for turn, max_tokens in enumerate(session["max_tokens"]):
            messages.append(user_message(wl, session, turn))
            body = {
                "model": SERVED,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            rec = await stream_turn(client, url, headers, body, args.request_timeout)
            rec.update(
                conversation=session["name"],
                turn=turn,
                system=session["system"],
                document=session["document"],
                send=rec["send"] - t0,
                end=rec["end"] - t0,
            )
            records.append(rec)
            if rec["error"]:
                return  # the history is broken: the rest of this conversation is not sent
            messages.append({"role": "assistant", "content": rec["text"]})

    async def worker(client) -> None:
        while True:
            try:
                session = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await conversation(client, session)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=30.0), limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return records, time.perf_counter() - t0


async def sample_loads(httpx, urls: list[str], every: float, stop_event: asyncio.Event) -> dict:
    """Integrates each replica's running + waiting (its /load report) over time."""
    busy = {u: 0.0 for u in urls}
    peak = {u: 0 for u in urls}
    samples = 0
    async with httpx.AsyncClient(timeout=2.0) as client:
        while not stop_event.is_set():
            replies = await asyncio.gather(*(client.get(f"{u}/load") for u in urls), return_exceptions=True)
            for u, r in zip(urls, replies):
                if not isinstance(r, BaseException) and r.status_code == 200:
                    j = r.json()
                    n = j.get("running", 0) + j.get("waiting", 0)
                    busy[u] += n * every
                    peak[u] = max(peak[u], n)
            samples += 1
            try:
                await asyncio.wait_for(stop_event.wait(), every)
            except TimeoutError:
                pass
    return {"busy_request_seconds": busy, "peak_running_waiting": peak, "samples": samples}


# ----------------------------------------------------------------------------------------------------------------- #
# one run
# ----------------------------------------------------------------------------------------------------------------- #

ROUTE_RE = re.compile(r"route model=\S+.* replica=(\S+) reason=(\S+) cached_blocks=(\d+) skipped=(\d+)")


def route_lines(log: Path, start: int) -> dict:
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    reasons: dict[str, int] = {}
    per_replica: dict[str, int] = {}
    skipped = passed_over = 0
    for m in ROUTE_RE.finditer(text):
        replica, reason, _, skip = m.group(1), m.group(2), int(m.group(3)), int(m.group(4))
        reasons[reason] = reasons.get(reason, 0) + 1
        per_replica[replica] = per_replica.get(replica, 0) + 1
        skipped += skip
        passed_over += skip > 0
    return {
        "reasons": reasons,
        "per_replica": per_replica,
        "candidates_skipped": skipped,
        "requests_with_skips": passed_over,
    }


def fleet_file(path: Path, model_dir: Path, urls: list[str], port: int, policy: str, args, admin: str) -> None:
    import yaml

    config = {
        "port": port,
        "admin_key": admin,
        "database_url": f"sqlite:///{path.with_suffix('.db')}",
        "models": [{"name": SERVED, "path": str(model_dir), "pools": [{"name": "local", "replicas": urls}]}],
        "routing": {"policy": policy, "load_bound": args.load_bound, "load_slack": args.load_slack},
        "tiers": {TIER: {"priority": 0, "weight": 1}},
        "overload": {"ttft_target_s": 3600},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def warm_replica(httpx, url: str, rng: random.Random) -> None:
    for n in (24, 200):
        content = "warm up " + " ".join(rng.choice(WORDS) for _ in range(n))
        r = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=120,
            json={
                "model": SERVED,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 4,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
        r.raise_for_status()


def imbalance(values: list[float]) -> float | None:
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean > 0 else None


def run_one(name: str, concurrency: int, args, model_dir: Path, wl: dict, run_dir: Path) -> dict:
    import httpx

    n = 1 if name == "baseline" else args.replicas
    kv = args.kv_cache_gib * (args.replicas if name == "baseline" else 1)
    policy, affinity = POLICY[name], name != "cache_aware_noaff"
    logs = run_dir / f"{name}-c{concurrency}"
    logs.mkdir(parents=True, exist_ok=True)
    env = thread_env(args.threads)
    ports = [free_port() for _ in range(n)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    print(
        f"\n== {LABELS[name]}, {concurrency} in flight: {n} replica(s) x {kv:.4g} GiB KV, policy {policy}, "
        f"affinity header {affinity}"
    )
    t_start = time.perf_counter()
    procs: list[subprocess.Popen] = []
    try:
        for i, port in enumerate(ports):
            procs.append(
                spawn(
                    [
                        sys.executable,
                        "-m",
                        "tokenfleet",
                        "replica",
                        "--model",
                        str(model_dir),
                        "--port",
                        str(port),
                        "--served-model-name",
                        SERVED,
                        "--kv-cache-gib",
                        f"{kv:.6g}",
                        "--max-model-len",
                        str(args.max_model_len),
                        "--drain-timeout",
                        "2",
                    ],
                    logs / f"replica{i}.log",
                    env,
                )
            )
        for i, (u, p) in enumerate(zip(urls, procs)):
            wait_healthy(httpx, u, p, 300, logs / f"replica{i}.log")
        rng = random.Random(f"routing-warm/{name}")
        for u in urls:
            warm_replica(httpx, u, rng)
        blocks = [httpx.get(f"{u}/load", timeout=5).json().get("num_blocks") for u in urls]
        gport, admin = free_port(), secrets.token_hex(16)
        fleet_file(logs / "fleet.yaml", model_dir, urls, gport, policy, args, admin)
        glog = logs / "gateway.log"
        gateway = spawn(
            [sys.executable, "-m", "tokenfleet", "gateway", "--config", str(logs / "fleet.yaml")], glog, env
        )
        procs.append(gateway)
        base = f"http://127.0.0.1:{gport}"
        wait_healthy(httpx, base, gateway, 300, glog)
        r = httpx.post(
            f"{base}/admin/v1/keys",
            json={"org": "bench-org", "user": "bench", "tier": TIER},
            headers={"Authorization": f"Bearer {admin}"},
            timeout=30,
        )
        r.raise_for_status()
        key = r.json()["key"]
        r = httpx.post(
            f"{base}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
            json={
                "model": SERVED,
                "messages": [{"role": "user", "content": "warm up the gateway"}],
                "max_tokens": 4,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
        r.raise_for_status()
        time.sleep(1.5)  # let a load report come in after the warm-up
        setup_s = time.perf_counter() - t_start
        before = [scrape(httpx, u) for u in urls]
        log_start = glog.stat().st_size

        async def measured():
            stop_event = asyncio.Event()
            sampler = asyncio.create_task(sample_loads(httpx, urls, args.sample_s, stop_event))
            try:
                return await run_workload(httpx, base, key, wl, args, affinity, concurrency)
            finally:
                stop_event.set()
                loads_out.update(await sampler)

        loads_out: dict = {}
        probe = CpuProbe()
        probe.start()
        records, wall = asyncio.run(measured())
        others = probe.stop(wall)
        time.sleep(0.5)  # the last requests' metrics land after their final chunk
        after = [scrape(httpx, u) for u in urls]
        routes = route_lines(glog, log_start)
    finally:
        stop(procs)
    (logs / "records.json").write_text(json.dumps(records))

    ok = [r for r in records if not r["error"]]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)

    def delta(metric: str) -> list[float]:
        return [a.get(metric, 0.0) - b.get(metric, 0.0) for a, b in zip(after, before)]

    req = delta("vllm:request_success_total")
    ptoks = delta("vllm:prompt_tokens_total")
    hits = delta("vllm:prefix_cache_hits_total")
    queries = delta("vllm:prefix_cache_queries_total")
    computed = [p - h for p, h in zip(ptoks, hits)]
    busy = [loads_out.get("busy_request_seconds", {}).get(u, 0.0) for u in urls]
    ttft = [1e3 * r["ttft"] for r in ok]
    later = [1e3 * r["ttft"] for r in ok if r["turn"] > 0]
    row = {
        "name": name,
        "label": LABELS[name],
        "concurrency": concurrency,
        "replicas": n,
        "kv_cache_gib_per_replica": kv,
        "num_blocks_per_replica": blocks,
        "policy": policy,
        "affinity_header": affinity,
        "load_bound": args.load_bound if policy == "cache_aware" else None,
        "load_slack": args.load_slack if policy == "cache_aware" else None,
        "requests": len(records),
        "ok": len(ok),
        "errors": sorted({r["error"] for r in records if r["error"]})[:5],
        "expected_requests": sum(len(c["users"]) for c in wl["sessions"]),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
        "replica_hit_rate": sum(hits) / sum(queries) if sum(queries) else None,
        "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99), "max": max(ttft, default=None)},
        "ttft_later_turns_ms": {"p50": pct(later, 50), "p99": pct(later, 99)},
        "per_replica": {
            "url": urls,
            "requests": req,
            "prompt_tokens": ptoks,
            "cached_tokens": hits,
            "computed_prompt_tokens": computed,
            "busy_request_seconds": busy,
            "peak_running_waiting": [loads_out.get("peak_running_waiting", {}).get(u) for u in urls],
            "preemptions": delta("vllm:num_preemptions_total"),
        },
        "imbalance": {
            "requests": imbalance(req),
            "computed_prompt_tokens": imbalance(computed),
            "prompt_tokens": imbalance(ptoks),
            "busy": imbalance(busy),
        },
        "routes": routes,
        "wall_s": wall,
        "setup_s": setup_s,
        "requests_per_s": len(ok) / wall if wall else None,
        "others_cpu": others,
        "load_samples": loads_out.get("samples"),
        "logs": str(logs),
    }
    hr = row["hit_rate"]
    print(
        f"   {len(ok)}/{len(records)} ok in {wall:.1f}s (setup {setup_s:.0f}s); hit rate "
        f"{'-' if hr is None else f'{100 * hr:.1f}%'}; TTFT p50/p99 {_f(row['ttft_ms']['p50'])}/"
        f"{_f(row['ttft_ms']['p99'])} ms; requests per replica {[int(x) for x in req]}; routes {routes['reasons']}"
    )
    return row


def _f(x, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


# ----------------------------------------------------------------------------------------------------------------- #
# report
# ----------------------------------------------------------------------------------------------------------------- #


def machine_info(args) -> dict:
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "memory": memory_total(),
        "python": platform.python_version(),
        "threads_per_process": args.threads,
    }


def write_report(path: Path, rep: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(rep, indent=1))
    rows = rep["runs"]
    L = _report_head(rep) + ["## Results", ""] + _results_table(rows)
    L += ["", "## Per replica", ""] + _per_replica_table(rows)
    L += ["", "## Routing decisions (gateway log)", ""] + _routes_table(rows)
    if any("loss_vs_baseline" in r for r in rows):
        L += [
            "",
            "## Hits missing against the ideal (same concurrency, conversation and turn)",
            "",
            "Cached tokens the baseline got and the run did not, as a share of all prompt tokens: on first turns (a "
            "replica prefilling a system prompt or document it had not seen yet) and on later turns (the "
            "conversation's history was not on the replica its turn went to).",
            "",
            "| in flight | run | first turns | later turns | later turns more than one block short |",
            "|---:|---|---:|---:|---:|",
        ]
        for r in rows:
            x = r.get("loss_vs_baseline")
            if x:
                t = x["baseline_prompt_tokens"] or 1
                L.append(
                    f"| {_concurrency(r, rep)} | {r['label']} | {100 * x['first_turn_tokens'] / t:.1f} % | "
                    f"{100 * x['later_turn_tokens'] / t:.1f} % | {x['later_turns_short']} |"
                )
    errors = [(r["label"], e) for r in rows for e in r["errors"]]
    if errors:
        L += ["", "Errors: " + "; ".join(f"{lab}: {e}" for lab, e in errors)]
    if rep.get("notes"):
        L += ["", "## Reading", ""] + [f"{n}\n" for n in rep["notes"]]
    L += [
        "",
        f"Total run time {rep['total_s']:.0f} s. Run directory (logs, fleet files, workload, per-request "
        f"records): `{rep['run_dir']}`.",
        "",
    ]
    path.write_text("\n".join(L))
    print(f"wrote {path} and {path.with_suffix('.json')}")


def _report_head(rep: dict) -> list[str]:
    m, w, c = rep["machine"], rep["workload"], rep["checkpoint"]
    rows, info = rep["runs"], c["info"]
    kv_tok = lambda gib: gib * 2**30 / info["kv_bytes_per_token"]  # noqa: E731
    slack = f", `load_slack` {w['load_slack']:g}" if "load_slack" in w else ""
    return [
        f"# Fleet routing — {rep['date']}",
        "",
        f"Command: `{rep['command']}`",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['memory']} RAM, {m['threads_per_process']} torch thread(s) "
        f"per process; Python {m['python']}; versions: "
        + ", ".join(f"{k} {v}" for k, v in rep["versions"].items())
        + ". Every replica, the gateway and the "
        "client share these cores, and other work (other engineers' test runs) may have been running on the "
        'machine at the same time: see the "other CPU" column.',
        "",
        f"Checkpoint: `{c['dir']}` — {c['source']}; hidden {info['hidden_size']}, layers "
        f"{info['num_hidden_layers']}, heads {info['num_attention_heads']}/{info['num_key_value_heads']} kv, "
        f"{info['torch_dtype']}: {info['kv_bytes_per_token']} bytes of KV cache per token.",
        "",
        f"Fleet: {w['replicas']} replicas (`python -m tokenfleet replica`, one process each) with "
        f"`--kv-cache-gib {w['kv_cache_gib']:g}` each (~{kv_tok(w['kv_cache_gib']):.0f} tokens, "
        f"{_blocks(rows, 'round_robin')} blocks), one `tokenfleet gateway` per run; the baseline (the ideal) is ONE "
        f"replica with {w['replicas']}x that ({w['replicas'] * w['kv_cache_gib']:g} GiB, "
        f"~{kv_tok(w['replicas'] * w['kv_cache_gib']):.0f} tokens, {_blocks(rows, 'baseline')} blocks) behind the "
        "same gateway. Replicas and gateway are restarted for every run (cold caches, empty prefix index). "
        f"`load_bound` {w['load_bound']:g}{slack} (cache_aware).",
        "",
        _workload_line(w),
        "",
        "Hit rate = Σ usage.prompt_tokens_details.cached_tokens / Σ usage.prompt_tokens over all requests (the "
        "replicas' own vllm:prefix_cache_hits/queries in brackets); % of ideal = that / the baseline's at the same "
        "concurrency. TTFT = send → first non-empty content chunk, through the gateway. Imbalance = max/mean over "
        "replicas of requests served (vllm:request_success), of prompt tokens computed (prompt − cache hits: the "
        "prefill work) and of time-integrated running+waiting (/load sampled every "
        f"{w['sample_s']:g} s). Targets: hit rate ≥ {100 * HIT_TARGET:.0f} % of the ideal, max/mean (requests) "
        f"≤ {IMBALANCE_TARGET}, and for cache_aware a TTFT p50 below round_robin's.",
        "",
    ]


def _workload_line(w: dict) -> str:
    flight = ", ".join(str(c) for c in w["concurrency"]) if isinstance(w["concurrency"], list) else w["concurrency"]
    common = (
        f"each turn sends the full history (with the replies the server returned); {flight} sessions in flight "
        "(one request each at a time); streaming chat completions with `x-conversation-id` for conversations unless "
        "the run says otherwise."
    )
    if w.get("trace", "chat") == "chat":
        return (
            f"Workload (`--trace chat`, seed {w['seed']}, the same for every run): {w['conversations']} conversations, "
            f"{w['system_prompts']} shared system prompts of ~{w['system_tokens']} tokens chosen uniformly, "
            f"{w['turns_min']}–{w['turns_max']} turns each ({w['total_requests']} requests), user messages "
            f"{w['user_min']}–{w['user_max']} tokens, replies max_tokens {w['max_tokens']} with ignore_eos; " + common
        )
    return (
        f"Workload (`--trace mixed`, issue 26's shape; seed {w['seed']}, the same for every run): "
        f"{w['conversations']} conversations of {w['turns_min']}–{w['turns_max']} turns over {w['system_prompts']} "
        f"shared system prompts of {w['system_tokens'].replace(',', '–')} tokens with uneven popularity (prompt i "
        f"chosen with weight 1/(i+1)), {100 * w['document_share']:.0f} % of them opening with one of "
        f"{w['documents']} shared documents of {w['document_tokens'].replace(',', '–')} tokens; user messages "
        f"{w['user_min']}–{w['user_max']} tokens; plus {w['one_offs']} one-off prompts "
        f"({100 * w['one_off_share']:.0f} % of the sessions: one turn of {w['one_off_tokens'].replace(',', '–')} "
        f"tokens, no system prompt, no conversation id); {w['total_requests']} requests, max_tokens "
        f"{w['max_tokens'].replace(',', '–')} with ignore_eos; " + common
    )


def _concurrency(row: dict, rep: dict | None = None) -> int:
    return row.get("concurrency") or (rep or {}).get("workload", {}).get("concurrency")


def _baseline_for(rows: list[dict], row: dict) -> dict | None:
    return next((r for r in rows if r["name"] == "baseline" and _concurrency(r) == _concurrency(row)), None)


def _verdict(rows: list[dict], r: dict, rel: float | None) -> str:
    if r["name"] == "baseline":
        return "reference"
    hit_ok = rel is not None and rel >= HIT_TARGET
    imb = r["imbalance"]["requests"]
    verdict = f"hit {'✅' if hit_ok else '❌'} load {'✅' if imb is not None and imb <= IMBALANCE_TARGET else '❌'}"
    rr = next((x for x in rows if x["name"] == "round_robin" and _concurrency(x) == _concurrency(r)), None)
    if r["policy"] == "cache_aware" and rr is not None and None not in (r["ttft_ms"]["p50"], rr["ttft_ms"]["p50"]):
        verdict += f" TTFT {'✅' if r['ttft_ms']['p50'] < rr['ttft_ms']['p50'] else '❌'}"
    return verdict


def _results_table(rows: list[dict]) -> list[str]:
    L = [
        "| in flight | run | ok | hit rate | % of ideal | TTFT p50 ms | TTFT p99 ms | max/mean requests | max/mean "
        "prefill computed | max/mean busy | req/s | other CPU | targets |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        hr, base = r["hit_rate"], _baseline_for(rows, r)
        rel = hr / base["hit_rate"] if (hr is not None and base and base["hit_rate"]) else None
        imb, oc = r["imbalance"], r["others_cpu"]
        L.append(
            f"| {_concurrency(r)} | {r['label']} | {r['ok']}/{r['expected_requests']} | {_p(hr)} "
            f"({_p(r['replica_hit_rate'])}) | {'-' if rel is None else f'{100 * rel:.1f} %'} | "
            f"{_f(r['ttft_ms']['p50'])} | {_f(r['ttft_ms']['p99'])} | {_f(imb['requests'], 2)} | "
            f"{_f(imb['computed_prompt_tokens'], 2)} | {_f(imb['busy'], 2)} | {_f(r['requests_per_s'], 2)} | "
            f"{'-' if oc is None else f'{100 * oc:.0f} %'}{' ⚠' if (oc or 0) > CONTENDED else ''} | "
            f"{_verdict(rows, r, rel)} |"
        )
    return L


def _per_replica_table(rows: list[dict]) -> list[str]:
    L = [
        "| in flight | run | requests | prompt tokens | cached | computed | busy (request·s) | peak running+waiting | "
        "preemptions |",
        "|---:|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda xs: " / ".join("-" if x is None else f"{x:.0f}" for x in xs)  # noqa: E731
    for r in rows:
        p = r["per_replica"]
        L.append(
            f"| {_concurrency(r)} | {r['label']} | {fmt(p['requests'])} | {fmt(p['prompt_tokens'])} | "
            f"{fmt(p['cached_tokens'])} | {fmt(p['computed_prompt_tokens'])} | {fmt(p['busy_request_seconds'])} | "
            f"{fmt(p['peak_running_waiting'])} | {fmt(p['preemptions'])} |"
        )
    return L


def _routes_table(rows: list[dict]) -> list[str]:
    L = [
        "| in flight | run | reasons | requests where the load bound passed over a preferred replica | TTFT p50/p99 "
        "ms, turns ≥ 2 | wall s |",
        "|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["routes"]["reasons"].items())) or "-"
        lt = r["ttft_later_turns_ms"]
        L.append(
            f"| {_concurrency(r)} | {r['label']} | {reasons} | {r['routes']['requests_with_skips']} | "
            f"{_f(lt['p50'])} / {_f(lt['p99'])} | {r['wall_s']:.0f} |"
        )
    return L


def add_losses(rep: dict) -> None:
    """Where each run's cache hits fell short of the baseline's at the same concurrency, request by request (same
    conversation and turn): on first turns (a replica prefilling a system prompt it had not seen) and on later turns
    (a conversation's history not where its turn went). Read from the runs' per-request records in the run
    directory."""
    rows = rep["runs"]
    for r in rows:
        base = _baseline_for(rows, r)
        if base is None or r is base or "loss_vs_baseline" in r:
            continue
        try:
            ref_records = json.loads((Path(base["logs"]) / "records.json").read_text())
            recs = json.loads((Path(r["logs"]) / "records.json").read_text())
        except OSError:
            continue
        ref = {(x["conversation"], x["turn"]): x for x in ref_records}
        first = later = moved = 0
        for x in recs:
            b = ref.get((x["conversation"], x["turn"]))
            if b is None or x["error"] or b["error"]:
                continue
            lost = (b["cached_tokens"] or 0) - (x["cached_tokens"] or 0)
            if x["turn"] == 0:
                first += lost
            else:
                later += lost
                moved += lost > 16  # more than one block short of the baseline on a later turn
        r["loss_vs_baseline"] = {
            "first_turn_tokens": first,
            "later_turn_tokens": later,
            "later_turns_short": moved,
            "baseline_prompt_tokens": sum(x["prompt_tokens"] or 0 for x in ref.values()),
        }


def _blocks(rows: list[dict], name: str) -> str:
    r = next((r for r in rows if r["name"] == name), None)
    return "?" if r is None or not r["num_blocks_per_replica"] else str(r["num_blocks_per_replica"][0])


def _p(x) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


# ----------------------------------------------------------------------------------------------------------------- #
# main
# ----------------------------------------------------------------------------------------------------------------- #


def main(argv=None) -> None:
    p = bench_parser(__doc__)
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"comma separated, from {ALL_RUNS}")
    p.add_argument("--trace", default="mixed", choices=TRACES)
    p.add_argument("--concurrency", default="8,64", help="sessions in flight, comma separated: every run at each")
    p.add_argument("--size", default="small", choices=["tiny", "small", "medium"], help="demo checkpoint size")
    p.add_argument("--model", default=None, help="a checkpoint folder instead of the demo checkpoint")
    p.add_argument("--ckpt-root", default="/tmp/tokenfleet-bench/routing-checkpoints")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="per replica (the baseline gets --replicas x this); default by trace, small demo: mixed 0.0625 GiB "
        "(2048 blocks: 16 sessions of the mixed trace fit), chat 0.0125 GiB (409 blocks: the active conversations "
        "need more than one replica's)",
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--load-bound", type=float, default=1.25, help="routing.load_bound (relative slack)")
    p.add_argument("--load-slack", type=float, default=8.0, help="routing.load_slack (absolute slack, sequences)")
    p.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per replica and gateway process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--system-prompts", type=int, default=6)
    p.add_argument("--system-tokens", default="300,640", help="MIN,MAX (chat: MAX)")
    p.add_argument("--documents", type=int, default=4, help="mixed: shared documents")
    p.add_argument("--document-tokens", default="200,400", help="mixed: MIN,MAX")
    p.add_argument("--document-share", type=float, default=0.4, help="mixed: conversations opening with a document")
    p.add_argument("--one-off-share", type=float, default=0.2, help="mixed: one-off prompts among the sessions")
    p.add_argument("--one-off-tokens", default="50,300", help="mixed: MIN,MAX")
    p.add_argument("--turns-min", type=int, default=3)
    p.add_argument("--turns-max", type=int, default=6)
    p.add_argument("--user-min", type=int, default=16)
    p.add_argument("--user-max", type=int, default=80)
    p.add_argument("--max-tokens", default="16,48", help="MIN,MAX per request (chat: MAX)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--sample-s", type=float, default=0.25, help="how often each replica's /load is sampled")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--out", default="docs/benchmarks/routing.md", help="markdown report ('' = none); JSON next to it")
    p.add_argument("--note", action="append", default=[], help="a paragraph for the report's Reading section")
    p.add_argument(
        "--rerender",
        default=None,
        metavar="JSON",
        help="run nothing: rewrite the markdown from a previous run's JSON (plus any --note)",
    )
    args = p.parse_args(argv)

    if args.rerender:
        rep, md = report_to_rerender(args)
        add_losses(rep)
        write_report(md, rep)
        return
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in runs if r not in ALL_RUNS]
    if bad:
        p.error(f"unknown runs {bad}; choose from {ALL_RUNS}")
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not concurrencies or min(concurrencies) < 1 or not 0 <= args.one_off_share < 1:
        p.error("--concurrency: whole numbers >= 1; --one-off-share: in [0, 1)")
    if args.kv_cache_gib is None:
        args.kv_cache_gib = KV_CACHE_GIB[args.trace]
    command = command_line(__file__)

    model_dir, source = ensure_checkpoint(args)
    info = checkpoint_info(model_dir)
    run_dir = make_run_dir(args.run_dir, "tokenfleet-routing-")
    wl = make_workload(args, model_dir)
    (run_dir / "workload.json").write_text(json.dumps(wl))
    total_requests = sum(len(c["users"]) for c in wl["sessions"])
    one_offs = sum(c["id"] is None for c in wl["sessions"])
    print(
        f"checkpoint {model_dir}; workload ({args.trace}): {len(wl['sessions'])} sessions ({one_offs} one-offs), "
        f"{total_requests} requests -> {run_dir / 'workload.json'}"
    )

    t_all = time.perf_counter()
    rows = [run_one(name, c, args, model_dir, wl, run_dir) for c in concurrencies for name in runs]
    total = time.perf_counter() - t_all
    print(f"\nall runs done in {total:.0f}s; run dir: {run_dir}")
    if not args.out:
        return
    keys = ["seed", "trace", "conversations", "system_prompts", "system_tokens", "turns_min", "turns_max"]
    keys += ["user_min", "user_max", "max_tokens", "replicas", "kv_cache_gib", "load_bound", "load_slack"]
    keys += ["sample_s", "max_model_len", "documents", "document_tokens", "document_share", "one_off_share"]
    keys += ["one_off_tokens"]
    rep = {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "command": command,
        "machine": machine_info(args),
        "versions": package_versions(("tokenfleet", "torch", "httpx", "uvicorn", "fastapi")),
        "checkpoint": {"dir": str(model_dir), "source": source, "info": info},
        "workload": {k: getattr(args, k) for k in keys}
        | {"concurrency": concurrencies, "total_requests": total_requests, "one_offs": one_offs},
        "runs": rows,
        "notes": args.note,
        "run_dir": str(run_dir),
        "total_s": total,
    }
    add_losses(rep)
    write_report((REPO / args.out) if not os.path.isabs(args.out) else Path(args.out), rep)


if __name__ == "__main__":
    main()
