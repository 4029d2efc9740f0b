#!/usr/bin/env python3
"""Fair-share benchmark: served-token shares of tiers and tenants under a skewed, permanently backlogged load,
through the real server, with and without the gateway's fair queueing.

Run by hand, never from the test suite:

    python bench/fair_share.py --duration 10 --warmup 3 --light-alone 5 --small-quantum-duration 5 --out ''
    python bench/fair_share.py --snapshot-code      # the report: about 5 minutes, plus any wait for idle CPUs

Server: `python -m tokenfleet serve --auth --config fleet.yaml --database-url sqlite:///RUN_DIR/...` on the demo
checkpoint (`tokenfleet demo-model --size small`, regenerated under --ckpt-root), one process (gateway + in-process
replica), its own session/process group, loopback only.  fleet.yaml (written per run into the run directory):
  admin_key          random; the harness creates one organisation + user + API key per tenant with
                     POST /admin/v1/keys {org, user, tier}.
  dispatch           slots_per_replica = --slots (default 8): at most that many requests run on the replica, the rest
                     wait at the gateway, where the fair dispatcher picks the order (weighted fair queuing across
                     tiers by token cost, deficit round-robin across the tenants of a tier).  quantum_tokens default.
  tiers              the default priority classes and weights (enterprise 0/8, paid 0/4, free 1/2, batch 2/1; free and
                     batch keep on_quota_outage: closed) but NO user/org limits (null = unlimited), so quotas never
                     refuse: this measures the dispatcher, not the quota.  (A tier named in fleet.yaml replaces the
                     default whole, hence all four are spelled out.)
  overload           ttft_target_s = 1000: the degradation ladder stays at level 0 (batch is never paused, free never
                     capped or shed).  The harness checks the level from /metrics during the run.

Load: closed loop.  Each tenant has N client tasks (--clients, default enterprise=8, paid-heavy=24, paid-light=2,
free=8, batch=8); each sends one streamed chat completion and, as soon as it ends, the next one, so every tenant is
permanently backlogged (except paid-light, whose 2 clients are deliberately fewer than its fair share).  Every request:
a fresh prompt of exactly --prompt-tokens tokens (random words, seeded per client, counted with the checkpoint's
tokenizer; the chat template adds a few), max_tokens = --max-tokens, ignore_eos, temperature 0, stream with
stream_options.include_usage, so every request costs the same tokens.  One httpx.AsyncClient per tenant in this process.

Phases:
  fair         slots = --slots.  --warmup s of load (queues fill, not counted), then a --duration s window.
  light-alone  same server, only paid-light's clients (--light-alone s window after 3 s; 0 = skip): its latency with
               nobody else on the machine, the reference for "is light's TTFT inflated by heavy's backlog?".
  contrast     a fresh server with slots = --contrast-slots (default 1000): nothing queues at the gateway, every
               request goes straight into the engine (first come first served within a priority class; all fit in
               one batch here, so the priority classes never matter): shares follow client concurrency, not weights.
               Same load, same window (--contrast 0 = skip).
  small_quantum  a fresh server like `fair` but with dispatch.quantum_tokens = --small-quantum (default 128, about
               one request of this workload, instead of the default 2048 = ~15 requests), a --small-quantum-duration s
               window (default 30; 0 = skip): how much of paid-light's wait is heavy's deficit round-robin turn.
At the end of a window the clients stop sending; requests in flight finish (not counted) before the next phase.

Measured per request (client side): queue wait = time until the HTTP response headers arrive (the gateway answers
only after the dispatcher granted a slot, so this is the time spent queued plus admission/relay set-up, ~ms);
TTFT = first chunk with non-empty delta.content - send; TPOT = (end - first content) / (completion tokens - 1);
served tokens = usage.prompt_tokens + usage.completion_tokens.  A request counts in a window when it ENDED inside it
(latency percentiles use the same requests).  Per tier: share of all served tokens vs the tier's weight share among
the tiers that were backlogged (queued at the gateway in >= 50% of the /metrics scrapes of the window; when nothing
queued, as in the contrast run, among the tiers with load), and the share of client concurrency for comparison.
Server side (scraped from /metrics every --scrape-interval s): overload level, quota refusals, per-tier queue
lengths, slots in use, the engine's running/waiting requests, and tokens dispatched per tier (the dispatcher's own
token accounting, a cross-check of the client's usage-based shares).  "Others" = CPU used by processes outside the
benchmark during the window, share of all cores (bench/_cpuprobe.py; > 10%: contended).

--snapshot-code: the servers import a copy of tokenfleet/ taken when the run starts (the report records git HEAD and
a hash of the uncommitted diff), so a working tree that others edit meanwhile cannot change the code mid-run.

Output: a markdown report (--out, default docs/benchmarks/fair_share.md) and a JSON next to it; server logs, fleet.yaml
files and raw per-request records stay in the run directory (printed at the end).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import hashlib
import json
import os
import random
import re
import secrets
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402  (stdlib only)
    CONTENDED,
    REPO,
    ChatStream,
    add_checkpoint_args,
    bench_parser,
    command_line,
    cpu_busy,
    make_run_dir,
    package_versions,
    pct,
    prompt_text,
    report_to_rerender,
    wait_idle,
)
from _cpuprobe import CpuProbe  # noqa: E402  (stdlib only)
from offline_throughput import checkpoint_info, ensure_checkpoint, machine_info  # noqa: E402  (stdlib only at import time)
from served_load import PortAllocator, Server  # noqa: E402  (stdlib only at import time)

SERVED_NAME = "bench"
# A tier queued at the gateway in at least this share of a window's scrapes counts as backlogged.  (A tier with
# enough clients still finds its queue empty now and then -- every request of it running -- and SFQ gives it no
# credit for that; the report shows each tier's fraction, so a share below the weight can be read against it.)
BACKLOGGED = 0.5
# The default tiers (tokenfleet.dispatch.tiers.default_tiers), limits removed: (priority class, weight, on_quota_outage).
TIERS = {"enterprise": (0, 8, "open"), "paid": (0, 4, "open"), "free": (1, 2, "closed"), "batch": (2, 1, "closed")}
# tenant -> (tier, concurrent clients); order = report order
DEFAULT_TENANTS = {
    "enterprise": ("enterprise", 8),
    "paid-heavy": ("paid", 24),
    "paid-light": ("paid", 2),
    "free": ("free", 8),
    "batch": ("batch", 8),
}
PHASE_LABELS = {
    "fair": "fair queueing (slots {slots})",
    "light_alone": "paid-light alone (slots {slots})",
    "small_quantum": "fair queueing, quantum {quantum} (slots {slots})",
    "contrast": "no gateway queueing (slots {slots})",
}
PHASE_ORDER = ("fair", "light_alone", "small_quantum", "contrast")


# ----------------------------------------------------------------------------------------------------------------- #
# server
# ----------------------------------------------------------------------------------------------------------------- #


def fleet_yaml(slots: int, admin_key: str, quantum: int | None = None) -> dict:
    tiers = {
        name: {"priority": prio, "weight": weight, "on_quota_outage": outage}  # no limits: unlimited
        for name, (prio, weight, outage) in TIERS.items()
    }
    dispatch = (
        {"slots_per_replica": slots} if quantum is None else {"slots_per_replica": slots, "quantum_tokens": quantum}
    )
    return {"admin_key": admin_key, "dispatch": dispatch, "tiers": tiers, "overload": {"ttft_target_s": 1000}}


def start_server(
    name: str, args, model_dir: Path, slots: int, run_dir: Path, ports, quantum: int | None = None
) -> tuple[Server, str, dict]:
    admin_key = "bench-admin-" + secrets.token_hex(8)
    cfg = fleet_yaml(slots, admin_key, quantum)
    cfg_path = run_dir / f"fleet_{name}.yaml"
    cfg_path.write_text(json.dumps(cfg, indent=1) + "\n")  # JSON is YAML
    db = run_dir / f"tenants_{name}.db"
    port = ports()
    cmd = [
        sys.executable,
        "-m",
        "tokenfleet",
        "serve",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--kv-cache-gib",
        f"{args.kv_cache_gib:g}",
        "--auth",
        "--config",
        str(cfg_path),
        "--database-url",
        f"sqlite:///{db}",
        "--drain-timeout",
        "5",
    ]
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    env.pop("TOKENFLEET_ADMIN_KEY", None)
    env.pop("TOKENFLEET_DATABASE_URL", None)
    code = str(args.code_root or REPO)
    env["PYTHONPATH"] = code + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    server = Server(name, cmd, port, env, run_dir / f"log_{name}.txt", run_dir)
    server.start()
    return server, admin_key, cfg


async def create_keys(base: str, admin_key: str, tenants: dict) -> dict[str, str]:
    import httpx

    keys = {}
    async with httpx.AsyncClient(
        base_url=base, timeout=30.0, headers={"authorization": f"Bearer {admin_key}"}
    ) as client:
        for tenant, (tier, _) in tenants.items():
            r = await client.post("/admin/v1/keys", json={"org": f"bench-{tenant}", "user": "load", "tier": tier})
            if r.status_code != 201:
                raise RuntimeError(f"creating a key for {tenant}: HTTP {r.status_code} {r.text[:300]}")
            keys[tenant] = r.json()["key"]
    return keys


# ----------------------------------------------------------------------------------------------------------------- #
# client
# ----------------------------------------------------------------------------------------------------------------- #


async def one_request(client, body: dict, timeout: float) -> dict:
    """One streamed chat completion; times are time.perf_counter()."""
    send = time.perf_counter()
    headers_t = status = err = None
    stream = ChatStream()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                headers_t = time.perf_counter()
                status = r.status_code
                err = await stream.read(r, 200)
    except TimeoutError:
        err = "timed out"
    except Exception as e:  # noqa: BLE001  (connection errors etc.: the request failed)
        err = f"{e.__class__.__name__}: {e}"[:200]
    end = time.perf_counter()
    first, usage = stream.first_content_at, stream.usage
    if err is None and (usage is None or first is None):
        err = "no usage" if usage is None else "no content chunk"
    u = usage or {}
    return {
        "send": send,
        "headers": headers_t,
        "first": first,
        "end": end,
        "status": status,
        "error": err,
        "prompt_tokens": u.get("prompt_tokens"),
        "completion_tokens": u.get("completion_tokens"),
    }


def _metric_line(line: str):
    m = re.match(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)", line)
    if not m:
        return None
    labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
    try:
        return m.group(1), labels, float(m.group(3))
    except ValueError:
        return None


def parse_metrics(text: str) -> dict:
    """The /metrics numbers this benchmark reads: {name: {label value or '': value}}."""
    wanted = {
        "tokenfleet_overload_level": None,
        "tokenfleet_projected_ttft_seconds": None,
        "tokenfleet_dispatch_slots": "state",
        "tokenfleet_dispatch_queued_requests": "tier",
        "tokenfleet_dispatch_tokens_total": "tier",
        "tokenfleet_dispatch_wait_seconds_total": "tier",
        "tokenfleet_quota_refusals_total": "tier",
        "tokenfleet_overload_shed_total": "tier",
        "vllm:num_requests_running": None,
        "vllm:num_requests_waiting": None,
    }
    out: dict = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        parsed = _metric_line(line)
        if parsed is None or parsed[0] not in wanted:
            continue
        name, labels, value = parsed
        key = labels.get(wanted[name], "") if wanted[name] else ""
        out.setdefault(name, {})
        out[name][key] = out[name].get(key, 0.0) + value
    return out


async def scrape(client) -> dict | None:
    try:
        r = await client.get("/metrics", timeout=10.0)
        return {"t": time.perf_counter(), **parse_metrics(r.text)} if r.status_code == 200 else None
    except Exception:  # noqa: BLE001
        return None


async def run_load(
    base: str, model_dir: Path, tenants: dict, keys: dict, args, warmup: float, duration: float, tag: str
) -> dict:
    """Closed-loop load from every tenant's clients: `warmup` s, then the `duration` s window; the clients stop
    sending at the window's end and their last requests finish."""
    import httpx
    from tokenizers import Tokenizer  # light (no torch)

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    clients = {
        t: httpx.AsyncClient(
            base_url=base,
            limits=limits,
            timeout=httpx.Timeout(args.request_timeout, connect=30.0),
            headers={"authorization": f"Bearer {keys[t]}"},
        )
        for t in tenants
    }
    plain = httpx.AsyncClient(base_url=base, timeout=10.0)
    records: list[dict] = []
    t0 = time.perf_counter()
    w_start, w_end = t0 + warmup, t0 + warmup + duration

    async def client_loop(tenant: str, index: int) -> None:
        rng = random.Random(f"fair-share/{args.seed}/{tag}/{tenant}/{index}")
        while time.perf_counter() < w_end:
            body = {
                "model": SERVED_NAME,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": prompt_text(rng, tok, args.prompt_tokens)}],
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            rec = await one_request(clients[tenant], body, args.request_timeout)
            rec.update(tenant=tenant, client=index)
            records.append(rec)
            if rec["error"] is not None:
                await asyncio.sleep(0.2)  # a failing server should not be hammered in a tight loop

    scrapes: list[dict] = []
    marks: dict[str, dict | None] = {}
    stop = asyncio.Event()

    async def scraper() -> None:
        while not stop.is_set():
            s = await scrape(plain)
            if s is not None:
                scrapes.append(s)
            try:
                await asyncio.wait_for(stop.wait(), args.scrape_interval)
            except TimeoutError:
                pass

    async def mark(name: str, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        marks[name] = await scrape(plain)

    probe = CpuProbe()
    busy_before = cpu_busy(0.5)
    side = [
        asyncio.create_task(scraper()),
        asyncio.create_task(mark("start", w_start)),
        asyncio.create_task(mark("end", w_end)),
    ]

    async def window_cpu() -> None:
        await asyncio.sleep(max(0.0, w_start - time.perf_counter()))
        probe.start()
        await asyncio.sleep(max(0.0, w_end - time.perf_counter()))
        marks["others_cpu"] = probe.stop(duration)  # type: ignore[assignment]

    side.append(asyncio.create_task(window_cpu()))
    loops = [asyncio.create_task(client_loop(t, i)) for t, (_, n) in tenants.items() for i in range(n)]
    await asyncio.gather(*loops)
    drained = time.perf_counter()
    await asyncio.gather(*side[1:])
    stop.set()
    await side[0]
    for c in [*clients.values(), plain]:
        await c.aclose()
    return {
        "t0": t0,
        "window": [w_start, w_end],
        "records": records,
        "scrapes": scrapes,
        "marks": marks,
        "busy_before": busy_before,
        "drain_s": drained - w_end,
    }


async def warm_server(base: str, key: str, model_dir: Path, args) -> list[dict]:
    """A few requests first (the first one may compile the CPU attention kernel and fill caches)."""
    import httpx
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(f"fair-share/{args.seed}/server-warmup")
    async with httpx.AsyncClient(base_url=base, timeout=600.0, headers={"authorization": f"Bearer {key}"}) as client:

        def body():
            return {
                "model": SERVED_NAME,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": prompt_text(rng, tok, args.prompt_tokens)}],
                "stream": True,
                "stream_options": {"include_usage": True},
            }

        recs = [await one_request(client, body(), 600.0) for _ in range(2)]
        recs += await asyncio.gather(*[one_request(client, body(), 600.0) for _ in range(8)])
    return recs


# ----------------------------------------------------------------------------------------------------------------- #
# analysis
# ----------------------------------------------------------------------------------------------------------------- #


def _stats(xs: list[float]) -> dict:
    return {"p50": pct(xs, 50), "p99": pct(xs, 99), "mean": statistics.mean(xs) if xs else None, "n": len(xs)}


def summarize(run: dict, tenants: dict, duration: float) -> dict:
    w_start, w_end = run["window"]
    recs = run["records"]
    inside = [r for r in recs if w_start <= r["end"] <= w_end]
    ok = [r for r in inside if r["error"] is None]
    errors: dict[str, int] = {}
    for r in recs:
        if r["error"] is not None:
            errors[r["error"][:120]] = errors.get(r["error"][:120], 0) + 1
    total = sum(r["prompt_tokens"] + r["completion_tokens"] for r in ok)
    out_tenants = {}
    for tenant, (tier, n) in tenants.items():
        mine = [r for r in ok if r["tenant"] == tenant]
        tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in mine)
        tpot = [(r["end"] - r["first"]) / (r["completion_tokens"] - 1) for r in mine if r["completion_tokens"] > 1]
        out_tenants[tenant] = {
            "tier": tier,
            "clients": n,
            "requests": len(mine),
            "tokens": tokens,
            "completion_tokens": sum(r["completion_tokens"] for r in mine),
            "tok_s": tokens / duration,
            "share": tokens / total if total else 0.0,
            "wait": _stats([r["headers"] - r["send"] for r in mine]),
            "wait_under_1s": (sum(1 for r in mine if r["headers"] - r["send"] < 1.0) / len(mine)) if mine else None,
            "ttft": _stats([r["first"] - r["send"] for r in mine]),
            "tpot": _stats(tpot),
            "e2e": _stats([r["end"] - r["send"] for r in mine]),
            "failed": sum(1 for r in inside if r["tenant"] == tenant and r["error"] is not None),
            "mean_prompt_tokens": statistics.mean(r["prompt_tokens"] for r in mine) if mine else None,
        }
    # server side, from /metrics
    scrapes = [s for s in run["scrapes"] if w_start <= s["t"] <= w_end]
    tiers_with_load = [t for t in TIERS if any(v[0] == t for v in tenants.values())]

    def series(name: str, key: str = "") -> list[float]:
        return [s.get(name, {}).get(key, 0.0) for s in scrapes]

    backlog = {
        t: (
            sum(1 for q in series("tokenfleet_dispatch_queued_requests", t) if q > 0) / len(scrapes)
            if scrapes
            else None
        )
        for t in tiers_with_load
    }
    queued_any = any((b or 0) > 0 for b in backlog.values())
    backlogged = [t for t in tiers_with_load if (backlog[t] or 0) >= BACKLOGGED] if queued_any else tiers_with_load
    m0, m1 = run["marks"].get("start"), run["marks"].get("end")
    dispatched = {}
    if m0 and m1:
        for t in tiers_with_load:
            dispatched[t] = m1.get("tokenfleet_dispatch_tokens_total", {}).get(t, 0.0) - m0.get(
                "tokenfleet_dispatch_tokens_total", {}
            ).get(t, 0.0)
    d_total = sum(dispatched.values())
    w_backlogged = sum(TIERS[t][1] for t in backlogged)
    clients_total = sum(n for _, n in tenants.values())
    out_tiers = {}
    for t in tiers_with_load:
        tokens = sum(v["tokens"] for v in out_tenants.values() if v["tier"] == t)
        share = tokens / total if total else 0.0
        wshare = TIERS[t][1] / w_backlogged if t in backlogged else None
        out_tiers[t] = {
            "weight": TIERS[t][1],
            "priority": TIERS[t][0],
            "tokens": tokens,
            "share": share,
            "weight_share": wshare,
            "ratio": share / wshare if wshare else None,
            "backlogged_frac": backlog[t],
            "backlogged": t in backlogged,
            "clients": sum(n for tier, n in tenants.values() if tier == t),
            "client_share": sum(n for tier, n in tenants.values() if tier == t) / clients_total,
            "dispatched_share": dispatched[t] / d_total if d_total else None,
        }
    levels = series("tokenfleet_overload_level")
    refusals = shed = None
    if m0 and m1:
        refusals = sum(m1.get("tokenfleet_quota_refusals_total", {}).values()) - sum(
            m0.get("tokenfleet_quota_refusals_total", {}).values()
        )
        shed = sum(m1.get("tokenfleet_overload_shed_total", {}).values()) - sum(
            m0.get("tokenfleet_overload_shed_total", {}).values()
        )
    mean = lambda xs: statistics.mean(xs) if xs else None  # noqa: E731
    return {
        "window_s": duration,
        "requests": len(ok),
        "tokens": total,
        "tok_s": total / duration,
        "completion_tok_s": sum(r["completion_tokens"] for r in ok) / duration,
        "tenants": out_tenants,
        "tiers": out_tiers,
        "backlogged_tiers": backlogged,
        "backlog_basis": "gateway queue" if queued_any else "tiers with load (nothing queued at the gateway)",
        "overload_level_max": max(levels) if levels else None,
        "quota_refusals": refusals,
        "shed": shed,
        "slots_in_use_mean": mean(series("tokenfleet_dispatch_slots", "in_use")),
        "gateway_queued_mean": mean([sum(s.get("tokenfleet_dispatch_queued_requests", {}).values()) for s in scrapes]),
        "engine_running_mean": mean(series("vllm:num_requests_running")),
        "engine_waiting_mean": mean(series("vllm:num_requests_waiting")),
        "scrapes": len(scrapes),
        "errors": errors,
        "failed_in_window": len(inside) - len(ok),
        "others_cpu": run["marks"].get("others_cpu"),
        "cpu_busy_before": run["busy_before"],
        "drain_s": run["drain_s"],
    }


def resummarize(rep: dict) -> None:
    """Redo each phase's analysis from the raw records the run directory still holds (so a rerendered report gets
    the current analysis); phases whose raw file is gone keep their stored summary."""
    run_dir = Path(rep["run_dir"])
    all_tenants = {t: tuple(v) for t, v in rep["workload"]["tenants"].items()}
    for srv in rep["servers"]:
        for phase, old in srv.get("phases", {}).items():
            raw = run_dir / f"requests_{phase}.json"
            if not raw.exists():
                continue
            data = json.loads(raw.read_text())
            if "marks" not in data:
                continue
            tenants = {t: all_tenants[t] for t in old["tenants_clients"]}
            run = {**data, "busy_before": old.get("cpu_busy_before"), "drain_s": old.get("drain_s")}
            new = summarize(run, tenants, old["window_s"])
            new.update({k: old[k] for k in ("label", "slots", "warmup_s", "tenants_clients")})
            srv["phases"][phase] = new


def _print_phase(name: str, s: dict) -> None:
    f = lambda x: "-" if x is None else f"{1e3 * x:.0f}"  # noqa: E731
    print(
        f"[{name}] {s['requests']} requests, {s['tok_s']:.0f} tok/s served; overload level max "
        f"{s['overload_level_max']}, quota refusals {s['quota_refusals']}, others CPU "
        + ("?" if s["others_cpu"] is None else f"{100 * s['others_cpu']:.0f}%"),
        flush=True,
    )
    for t, v in s["tiers"].items():
        ws = "-" if v["weight_share"] is None else f"{100 * v['weight_share']:.1f}%"
        bl = "-" if v["backlogged_frac"] is None else f"{100 * v['backlogged_frac']:.0f}%"
        print(
            f"    tier {t:<10} share {100 * v['share']:5.1f}%  weight share {ws:>6}  client share "
            f"{100 * v['client_share']:4.1f}%  queued in {bl} of scrapes",
            flush=True,
        )
    for t, v in s["tenants"].items():
        print(
            f"    {t:<11} {v['requests']:4d} req {v['tokens']:7d} tok ({100 * v['share']:5.1f}%)  wait p50/p99 "
            f"{f(v['wait']['p50'])}/{f(v['wait']['p99'])} ms  TTFT p50/p99 {f(v['ttft']['p50'])}/"
            f"{f(v['ttft']['p99'])} ms  TPOT p50 {f(v['tpot']['p50'])} ms",
            flush=True,
        )
    if s["errors"]:
        print(f"    errors: {s['errors']}", flush=True)


# ----------------------------------------------------------------------------------------------------------------- #
# orchestration
# ----------------------------------------------------------------------------------------------------------------- #


def run_server_phases(
    name: str,
    slots: int,
    phases: list[tuple[str, dict, float, float]],
    args,
    model_dir: Path,
    run_dir: Path,
    ports,
    all_tenants: dict,
    quantum: int | None = None,
) -> dict:
    """Start a server with `slots` (and DRR `quantum`, None = the default), create the tenants' keys, run each
    (phase, tenants, warmup, duration), stop it."""
    out: dict = {"server": name, "slots": slots, "quantum": quantum, "phases": {}}
    out["cpu_busy_before_start"] = wait_idle(args.wait_idle)
    t = time.perf_counter()
    server, admin_key, cfg = start_server(name, args, model_dir, slots, run_dir, ports, quantum)
    out["command"] = " ".join(shlex.quote(c) for c in server.cmd)
    out["fleet_yaml"] = {**cfg, "admin_key": "<random>"}
    try:
        server.wait_healthy(args.start_timeout)
        keys = asyncio.run(create_keys(server.base, admin_key, all_tenants))
        warm = asyncio.run(warm_server(server.base, keys[next(iter(all_tenants))], model_dir, args))
        bad = [r["error"] for r in warm if r["error"] is not None]
        if bad:
            raise RuntimeError(f"warm-up failed: {bad[:2]}")
        out["ready_s"] = time.perf_counter() - t
        print(
            f"[{name}] server ready (slots {slots}) in {out['ready_s']:.1f}s incl. warm-up; log {server.log}",
            flush=True,
        )
        for phase, tenants, warmup, duration in phases:
            print(
                f"[{phase}] {warmup:g}s warm-up + {duration:g}s window, tenants "
                + ", ".join(f"{t}×{n}" for t, (_, n) in tenants.items()),
                flush=True,
            )
            run = asyncio.run(run_load(server.base, model_dir, tenants, keys, args, warmup, duration, phase))
            s = summarize(run, tenants, duration)
            s.update(
                label=PHASE_LABELS[phase].format(slots=slots, quantum=quantum),
                slots=slots,
                warmup_s=warmup,
                tenants_clients={t: n for t, (_, n) in tenants.items()},
            )
            out["phases"][phase] = s
            (run_dir / f"requests_{phase}.json").write_text(
                json.dumps(
                    {
                        "window": run["window"],
                        "records": run["records"],
                        "scrapes": run["scrapes"],
                        "marks": run["marks"],
                    }
                )
            )
            _print_phase(phase, s)
            time.sleep(1.0)
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{e.__class__.__name__}: {e}"
        print(f"[{name}] FAILED: {out['error']}\n{server.log_tail()}", flush=True)
    finally:
        out["stopped"] = server.stop(args.stop_timeout)
    return out


def snapshot_code(run_dir: Path) -> dict:
    """Copy tokenfleet/ as it is now into the run directory; every server of the run imports that copy (first on
    PYTHONPATH), so edits others make to the working tree meanwhile cannot change the code mid-run."""
    dest = run_dir / "code"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(REPO / "tokenfleet", dest / "tokenfleet", ignore=shutil.ignore_patterns("__pycache__"))
    info = {"dir": str(dest), "taken": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        info["head"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, timeout=10
        ).stdout.strip()
        diff = subprocess.run(
            ["git", "diff", "HEAD", "--", "tokenfleet"], capture_output=True, text=True, cwd=REPO, timeout=30
        ).stdout
        untracked = subprocess.run(
            ["git", "ls-files", "--others", "--exclude-standard", "--", "tokenfleet"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=30,
        ).stdout.split()
        (run_dir / "code.diff").write_text(diff)
        digest = hashlib.sha256(diff.encode())
        for rel in sorted(untracked):
            digest.update(rel.encode() + (REPO / rel).read_bytes())
        info.update(diff_lines=diff.count("\n"), untracked_files=len(untracked), sha256=digest.hexdigest()[:16])
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# ----------------------------------------------------------------------------------------------------------------- #
# report
# ----------------------------------------------------------------------------------------------------------------- #


def _ms(x, nd: int = 0) -> str:
    return "—" if x is None else f"{1e3 * x:.{nd}f}"


def _num(x) -> str:
    return "—" if x is None else f"{x:g}"


def _pc(x, nd: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{nd}f}%"


def write_report(path: Path, rep: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(rep, indent=1))
    m, c, w = rep["machine"], rep["checkpoint"], rep["workload"]
    phases = {k: v for srv in rep["servers"] for k, v in srv.get("phases", {}).items()}
    fair, alone, contrast = phases.get("fair"), phases.get("light_alone"), phases.get("contrast")
    small = phases.get("small_quantum")
    L = [
        f"# Fair share under a skewed multi-tenant load — {rep['date']}",
        "",
        f"Command: `{rep['command']}`",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['memory']} RAM, torch threads {m['threads_used']}; Python "
        f"{m['python']}; versions: "
        + ", ".join(
            f"{k} {'(the snapshot below)' if k == 'tokenfleet' and rep.get('code_snapshot') else v}"
            for k, v in rep["versions"].items()
        ),
        "",
    ]
    snap = rep.get("code_snapshot")
    if snap:
        L += [
            f"Code: every server ran a copy of `tokenfleet/` taken at {snap['taken']} (git {snap.get('head')} plus "
            f"the working tree's uncommitted changes then: {snap.get('diff_lines', '?')} diff lines, "
            f"{snap.get('untracked_files', '?')} untracked files, sha256 {snap.get('sha256', '?')}; the diff is "
            "`code.diff` in the run directory), because other work was editing the tree during the run.",
            "",
        ]
    L += [
        f"Checkpoint: `{c['dir']}` — {c['source']}; {c['info'].get('parameters', 0) / 1e6:.1f}M parameters, "
        f"random weights. One `tokenfleet serve --auth` process (gateway + in-process replica), KV cache "
        f"{w['kv_cache_gib']:g} GiB.",
        "",
        "Load: closed loop, every client resends as soon as its request ends. Tenants (one organisation, user and "
        "API key each, created with POST /admin/v1/keys): "
        + ", ".join(f"{t} ({tier}, {n} clients)" for t, (tier, n) in w["tenants"].items())
        + f". Every request: a fresh {w['prompt_tokens']}-token prompt (+ chat template), max_tokens "
        f"{w['max_tokens']}, ignore_eos, streamed with usage, so every request costs the same tokens. "
        f"Warm-up {w['warmup']:g} s (not counted), then a {w['duration']:g} s window; a request counts when it "
        f"ended inside the window.",
        "",
        "fleet.yaml: default tier priorities/weights (enterprise 0/8, paid 0/4, free 1/2, batch 2/1) with NO "
        "user/org limits (quotas never refuse), `overload: {ttft_target_s: 1000}` (ladder stays at level 0), "
        f"`dispatch: {{slots_per_replica: {w['slots']}}}` (quantum_tokens default 2048) for the fair run"
        + (
            f", the same with `quantum_tokens: {w['small_quantum']}` for the small-quantum run"
            if w.get("small_quantum_duration")
            else ""
        )
        + f", slots_per_replica {w['contrast_slots']} for the no-queueing run (nothing queues at the gateway; the "
        "engine takes every request at once).",
        "",
        "Served tokens = usage prompt + completion tokens. Queue wait = time to the HTTP response headers (the "
        "gateway answers only once the dispatcher granted a slot). TTFT = first non-empty content chunk. TPOT = "
        '(end − first content) / (completion tokens − 1). Times in ms. "Others" = CPU used by processes outside '
        f"the benchmark during the window, share of all cores (>{100 * CONTENDED:.0f}%: contended).",
        "",
    ]
    if fair or contrast:
        L += [
            "## Tier shares of served tokens vs weights",
            "",
            "Weight share = the tier's weight over the weights of the tiers that were backlogged (queued at the "
            f"gateway in ≥ {100 * BACKLOGGED:.0f}% of the window's /metrics scrapes). Client share = the tier's "
            "share of the concurrent clients, which is what an unfair FIFO gives.",
            "",
            "| tier | weight | weight share | **fair run: token share** | share / weight share | "
            "backlogged (scrapes) | dispatcher's own token share | "
            + (f"fair run, quantum {w['small_quantum']}: token share | " if small else "")
            + "client share | **no-queueing run: token share** |",
            "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if small else "") + "---:|---:|",
        ]
        ref = fair or contrast
        for t in ref["tiers"]:
            f_ = (fair or {}).get("tiers", {}).get(t, {})
            c_ = (contrast or {}).get("tiers", {}).get(t, {})
            q_ = (small or {}).get("tiers", {}).get(t, {})
            wshare = f_.get("weight_share") if fair else c_.get("weight_share")
            ratio = "—" if f_.get("ratio") is None else f"{f_['ratio']:.2f}"
            L.append(
                f"| {t} | {ref['tiers'][t]['weight']} | {_pc(wshare)} | **{_pc(f_.get('share'))}** | {ratio} | "
                f"{_pc(f_.get('backlogged_frac'), 0)} | {_pc(f_.get('dispatched_share'))} | "
                + (f"{_pc(q_.get('share'))} | " if small else "")
                + f"{_pc(ref['tiers'][t]['client_share'])} | **{_pc(c_.get('share'))}** |"
            )
        L.append("")
    L += [
        "## Per tenant",
        "",
        "| run | tenant | tier | clients | requests | served tokens | tok/s | share | queue wait p50 | wait p99 | "
        "**TTFT p50** | **TTFT p99** | TPOT p50 | E2E p50 | failed |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in PHASE_ORDER:
        s = phases.get(key)
        if not s:
            continue
        for t, v in s["tenants"].items():
            L.append(
                f"| {s['label']} | {t} | {v['tier']} | {v['clients']} | {v['requests']} | {v['tokens']} | "
                f"{v['tok_s']:.0f} | {_pc(v['share'])} | {_ms(v['wait']['p50'])} | {_ms(v['wait']['p99'])} | "
                f"**{_ms(v['ttft']['p50'])}** | **{_ms(v['ttft']['p99'])}** | {_ms(v['tpot']['p50'], 1)} | "
                f"{_ms(v['e2e']['p50'])} | {v['failed']} |"
            )
    L.append("")
    if fair and "paid-light" in fair["tenants"]:
        L += [
            "## Paid tier: heavy vs light",
            "",
            "| tenant, run | clients | tok/s | share of paid tier | queue wait p50 / p99 | requests queued < 1 s | "
            "TTFT p50 / p99 | TPOT p50 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rows = [
            ("paid-heavy", fair, "fair run"),
            ("paid-light", fair, "fair run"),
            ("paid-light", alone, "alone"),
            ("paid-heavy", small, f"fair run, quantum {w['small_quantum']}"),
            ("paid-light", small, f"fair run, quantum {w['small_quantum']}"),
            ("paid-heavy", contrast, "no-queueing run"),
            ("paid-light", contrast, "no-queueing run"),
        ]
        for t, s, lab in rows:
            if not s or t not in s["tenants"]:
                continue
            v = s["tenants"][t]
            paid = sum(x["tokens"] for x in s["tenants"].values() if x["tier"] == "paid")
            L.append(
                f"| {t}, {lab} | {v['clients']} | {v['tok_s']:.0f} | {_pc(v['tokens'] / paid if paid else None)} "
                f"| {_ms(v['wait']['p50'])} / {_ms(v['wait']['p99'])} | {_pc(v.get('wait_under_1s'), 0)} | "
                f"{_ms(v['ttft']['p50'])} / "
                f"{_ms(v['ttft']['p99'])} | {_ms(v['tpot']['p50'], 1)} |"
            )
        L.append("")
    L += [
        "## Run health",
        "",
        "| run | window s | served tok/s | completion tok/s | requests | overload level (max) | quota refusals | "
        "shed | slots in use (mean) | queued at gateway (mean) | engine running / waiting (mean) | others | "
        "failed / errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key in PHASE_ORDER:
        s = phases.get(key)
        if not s:
            continue
        f1 = lambda x: "—" if x is None else f"{x:.1f}"  # noqa: E731
        oc = _pc(s["others_cpu"], 0) + (" ⚠" if (s["others_cpu"] or 0) > CONTENDED else "")
        err = "; ".join(f"{k} ×{v}" for k, v in s["errors"].items())
        L.append(
            f"| {s['label']} | {s['window_s']:g} | {s['tok_s']:.0f} | {s['completion_tok_s']:.0f} | "
            f"{s['requests']} | {_num(s['overload_level_max'])} | {_num(s['quota_refusals'])} | "
            f"{_num(s['shed'])} | {f1(s['slots_in_use_mean'])} | {f1(s['gateway_queued_mean'])} | "
            f"{f1(s['engine_running_mean'])} / {f1(s['engine_waiting_mean'])} | {oc} | "
            f"{s['failed_in_window']} {err[:150]} |"
        )
    L += ["", "## Servers", ""]
    for srv in rep["servers"]:
        L.append(
            f"- **{srv['server']}** (slots_per_replica {srv['slots']}"
            + (f", quantum_tokens {srv['quantum']}" if srv.get("quantum") else "")
            + f"): `{srv.get('command', '')}`; fleet.yaml "
            f"`{json.dumps(srv.get('fleet_yaml', {}))}`"
            + (f"; ready after {srv['ready_s']:.1f} s incl. warm-up" if srv.get("ready_s") else "")
            + (f"; **failed: {srv['error']}**" if srv.get("error") else "")
            + "."
        )
    if rep.get("reading"):
        L += ["", "## Reading", ""] + [x for paragraph in rep["reading"] for x in (paragraph, "")]
        L.append("(Written after the run and added with `--rerender ... --reading ...`; the tables are the run's.)")
    if rep.get("notes"):
        L += ["", "## Notes", ""] + [f"- {n}" for n in rep["notes"]]
    L += [
        "",
        "Methodology: see the docstring of `bench/fair_share.py`; raw per-request records, /metrics scrapes, "
        f"fleet.yaml files and server logs are in the run directory (`{rep['run_dir']}`).",
        "",
    ]
    path.write_text("\n".join(L))
    print(f"wrote {path} and {path.with_suffix('.json')}")


# ----------------------------------------------------------------------------------------------------------------- #
# main
# ----------------------------------------------------------------------------------------------------------------- #


def parse_clients(spec: str) -> dict:
    tenants = dict(DEFAULT_TENANTS)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, n = part.partition("=")
        if name not in tenants or not n.isdigit():
            raise ValueError(f"--clients: expected NAME=N with NAME in {list(tenants)}, got {part!r}")
        tenants[name] = (tenants[name][0], int(n))
    return {t: v for t, v in tenants.items() if v[1] > 0}


def main(argv=None) -> None:
    p = bench_parser(__doc__)
    add_checkpoint_args(p, "fair-share-ckpt", sizes=("tiny", "small", "medium"))
    p.add_argument("--duration", type=float, default=60.0, help="measured window of each mixed run, seconds")
    p.add_argument("--warmup", type=float, default=10.0, help="load before each window, not counted, seconds")
    p.add_argument(
        "--light-alone", type=float, default=20.0, help="window of the paid-light-alone run, seconds (0 = skip)"
    )
    p.add_argument(
        "--contrast",
        type=float,
        default=None,
        help="window of the no-queueing run, seconds (default: --duration; 0 = skip)",
    )
    p.add_argument("--slots", type=int, default=8, help="dispatch.slots_per_replica of the fair run")
    p.add_argument("--contrast-slots", type=int, default=1000, help="dispatch.slots_per_replica of the contrast run")
    p.add_argument(
        "--small-quantum",
        type=int,
        default=128,
        help="dispatch.quantum_tokens of the extra fair run (default 128, about one request here)",
    )
    p.add_argument(
        "--small-quantum-duration",
        type=float,
        default=30.0,
        help="window of the extra fair run with --small-quantum, seconds (0 = skip)",
    )
    p.add_argument(
        "--clients",
        default="",
        help="concurrent clients per tenant, e.g. paid-heavy=24,paid-light=2 "
        f"(default: {', '.join(f'{t}={n}' for t, (_, n) in DEFAULT_TENANTS.items())})",
    )
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between /metrics scrapes")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--base-port", type=int, default=18600, help="first loopback port to try")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--stop-timeout", type=float, default=20.0, help="SIGTERM, then SIGKILL after this many seconds")
    p.add_argument(
        "--wait-idle",
        type=int,
        default=30,
        help="before each server, wait up to this many seconds for other work on the machine to stop",
    )
    p.add_argument(
        "--snapshot-code",
        action="store_true",
        help="run the servers on a copy of tokenfleet/ taken at start (for a working tree others edit)",
    )
    p.add_argument("--out", default="docs/benchmarks/fair_share.md", help="'' = no report files")
    p.add_argument("--run-dir", help="where logs, fleet.yaml files and raw records go (default: a new temp dir)")
    p.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    p.add_argument(
        "--reading",
        action="append",
        default=[],
        help="with --rerender: a paragraph for the report's Reading section (repeatable; replaces it)",
    )
    p.add_argument(
        "--rerender",
        metavar="JSON",
        help="do not run anything: rewrite the markdown from a previous run's JSON (plus any --note lines)",
    )
    args = p.parse_args(argv)

    if args.rerender:
        rep, md = report_to_rerender(args)
        if args.reading:
            rep["reading"] = args.reading
        resummarize(rep)
        write_report(md, rep)
        return
    try:
        tenants = parse_clients(args.clients)
    except ValueError as e:
        p.error(str(e))
    contrast = args.duration if args.contrast is None else args.contrast
    command = command_line(__file__)

    model_dir, source = ensure_checkpoint(args)
    info = checkpoint_info(model_dir)
    print(f"checkpoint: {model_dir} ({source}; {info['parameters'] / 1e6:.1f}M params)")
    run_dir = make_run_dir(args.run_dir, "tokenfleet-fair-")
    # the tree may change (commits by others) while the run goes on
    versions_at_start = package_versions(("tokenfleet", "torch", "httpx", "uvicorn", "fastapi"))
    snapshot = snapshot_code(run_dir) if args.snapshot_code else None
    args.code_root = Path(snapshot["dir"]) if snapshot else None
    if snapshot:
        print(f"servers run a snapshot of tokenfleet/: {snapshot}")
    ports = PortAllocator(args.base_port)
    t_all = time.perf_counter()

    servers = []
    fair_phases = [("fair", tenants, args.warmup, args.duration)]
    if args.light_alone > 0 and "paid-light" in tenants:
        fair_phases.append(("light_alone", {"paid-light": tenants["paid-light"]}, 3.0, args.light_alone))
    servers.append(run_server_phases("fair", args.slots, fair_phases, args, model_dir, run_dir, ports, tenants))
    if args.small_quantum_duration > 0:
        servers.append(
            run_server_phases(
                "small_quantum",
                args.slots,
                [("small_quantum", tenants, args.warmup, args.small_quantum_duration)],
                args,
                model_dir,
                run_dir,
                ports,
                tenants,
                args.small_quantum,
            )
        )
    if contrast > 0:
        servers.append(
            run_server_phases(
                "contrast",
                args.contrast_slots,
                [("contrast", tenants, args.warmup, contrast)],
                args,
                model_dir,
                run_dir,
                ports,
                tenants,
            )
        )
    total = time.perf_counter() - t_all
    print(f"\nall done in {total:.0f}s; run dir (logs, fleet.yaml, raw records): {run_dir}")

    notes = list(args.note)
    for srv in servers:
        for s in srv.get("phases", {}).values():
            if (s.get("others_cpu") or 0) > CONTENDED:
                notes.append(
                    f"Other processes used {100 * s['others_cpu']:.0f}% of the CPUs during the {s['label']} "
                    "window: absolute rates and latencies there are depressed/noisy (shares less so)."
                )
            if s.get("overload_level_max"):
                notes.append(
                    f"The overload ladder left level 0 during the {s['label']} window (max level "
                    f"{s['overload_level_max']}): batch may have been paused, free capped."
                )
            if s.get("quota_refusals"):
                notes.append(f"{s['quota_refusals']:.0f} quota refusals during the {s['label']} window.")
    if args.out:
        rep = {
            "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "command": command,
            "machine": machine_info(args),
            "versions": versions_at_start,
            "checkpoint": {"dir": str(model_dir), "source": source, "info": info},
            "workload": {
                "tenants": tenants,
                "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens,
                "duration": args.duration,
                "warmup": args.warmup,
                "light_alone": args.light_alone,
                "contrast": contrast,
                "slots": args.slots,
                "contrast_slots": args.contrast_slots,
                "small_quantum": args.small_quantum,
                "small_quantum_duration": args.small_quantum_duration,
                "kv_cache_gib": args.kv_cache_gib,
                "seed": args.seed,
            },
            "servers": servers,
            "notes": notes,
            "run_dir": str(run_dir),
            "total_s": total,
            "code_snapshot": snapshot,
        }
        write_report((REPO / args.out) if not os.path.isabs(args.out) else Path(args.out), rep)


if __name__ == "__main__":
    main()
