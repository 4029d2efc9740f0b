#!/usr/bin/env python3
"""Disaggregated prefill/decode against colocated chunked prefill on the same processes (issue 20), measured on real
servers and predicted by the simulator with this machine's calibration, side by side in one run.

    nice -n 10 python bench/pd_split.py                                 # report: docs/benchmarks/pd_split.md
    nice -n 10 python bench/pd_split.py --duration 20 --out ''         # quick check (prints the report)

Two layouts, each 2 replica processes (`tokenfleet replica --threads 1`, the same checkpoint and KV cache) behind
one `tokenfleet gateway`, started fresh, warmed up, measured, stopped:
  colocated      2 replicas `--role both`: every replica mixes prefill chunks into its decode steps (the engine's
                 chunked prefill, --max-num-batched-tokens per step).
  disaggregated  1 `--role prefill` + 1 `--role decode` (one pool with `role:` per pool in fleet.yaml): the gateway
                 has a prompt of >= 64 uncached tokens computed by the prefill replica, which pushes its KV blocks over
                 TCP to the decode replica, then streams from the decode replica (shorter prompts: the decode replica
                 computes them itself, routing.remote_prefill_min_tokens).

Workload (the same, seeded, in both layouts), streamed chat completions through the gateway (ignore_eos,
temperature 0) from one asyncio httpx client in this process:
  background  --streams closed-loop clients, each sending one short-prompt long-output request after the other
              (prompts --stream-prompt tokens, --stream-output output tokens) from t=0 until --duration: their
              inter-token latency is what the split is meant to protect.
  bursts      every --burst-every s from --first-burst s on, --burst-size long prompts (--burst-prompt tokens,
              --burst-output output tokens) sent at the same instant.
Measured per layout: inter-token latency (gaps between content chunks as the client sees them) p50/p99/max of the
background streams, TTFT p50/p99 of both classes, the burst requests' ITL, KV bytes/blocks moved and transfer time
(the replicas' tokenfleet:kv_transfer_* counters), failed requests, prefill fallbacks in the gateway's log, and the
other processes' CPU share during the window (bench/_cpuprobe.py).

Simulator: the calibration fits the cost model's step coefficients (tokenfleet/sim/calibration.py: replay with the
engine's CPU clock, one torch thread, least squares) on an in-process engine with the replicas' settings, replaying
bursts of long prompts over decoding streams; the KV link is this machine's loopback TCP, measured with the
transport's own framing (replica/kv_transport.py). The simulator then runs both layouts (sim Fleet with 2 replicas;
sim DisaggFleet 1 + 1) on the same workload: the same burst instants and prompt lengths (plus the chat template's
tokens, measured), the same closed-loop background streams, and short prompts kept on the decode replica as the
gateway does. Its TTFT in the disaggregated layout ends at the prefill replica's first token, while our gateway
streams the first token from the decode replica after the transfer: the report gives both (the latter as "client
TTFT"). Predicted / measured is given for every number.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402  (stdlib only)
    CONTENDED,
    REPO,
    add_checkpoint_args,
    bench_parser,
    command_line,
    cpu_model,
    git_head,
    make_run_dir,
    memory_total,
    pct,
    prompt_text,
    repo_env,
)
from _cpuprobe import CpuProbe  # noqa: E402  (stdlib only)
from offline_throughput import ensure_checkpoint  # noqa: E402  (stdlib only at import time)
from served_load import (  # noqa: E402  (stdlib only at import time)
    ADMIN_KEY,
    BENCH_TIER,
    SERVED_NAME,
    PortAllocator,
    Server,
    _client,
    auth_headers,
    gateway_env,
    request_body,
    stream_request,
)

LAYOUTS = ("colocated", "disaggregated")
ROLES = {"colocated": ("both", "both"), "disaggregated": ("prefill", "decode")}
FIRST_PORT = 18300  # clear of 8000 and 8100-8102 (kept for other work on this machine)


# ----------------------------------------------------------------------------------------------------------------- #
# workload
# ----------------------------------------------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Shape:
    duration_s: float
    streams: int
    stream_prompt: tuple[int, int]
    stream_output: int
    burst_every_s: float
    burst_size: int
    burst_prompt: tuple[int, int]
    burst_output: int
    first_burst_s: float
    seed: int

    def burst_times(self) -> list[float]:
        count = max(0, math.ceil((self.duration_s - self.first_burst_s) / self.burst_every_s))
        return [self.first_burst_s + k * self.burst_every_s for k in range(count)]


@dataclass(frozen=True)
class Prompt:
    content: str
    tokens: int  # the content's tokens, before the chat template adds its own
    max_tokens: int


class Workload:
    """The seeded prompts: each burst's, and each background stream's n-th request (made when it is asked for, the
    same in every layout)."""

    def __init__(self, shape: Shape, tokenizer) -> None:
        self.shape, self.tokenizer = shape, tokenizer
        self.bursts = [
            (at, [self._burst_prompt(b, i) for i in range(shape.burst_size)])
            for b, at in enumerate(shape.burst_times())
        ]
        self._streams: dict[tuple[int, int], Prompt] = {}

    def _burst_prompt(self, burst: int, index: int) -> Prompt:
        rng = random.Random(f"pd-split/{self.shape.seed}/burst{burst}/{index}")
        n = rng.randint(*self.shape.burst_prompt)
        return Prompt(prompt_text(rng, self.tokenizer, n), n, self.shape.burst_output)

    def _stream_rng(self, stream: int, nth: int) -> random.Random:
        return random.Random(f"pd-split/{self.shape.seed}/stream{stream}/{nth}")

    def stream_length(self, stream: int, nth: int) -> int:
        """The content tokens of a background stream's n-th prompt (what the simulator needs of it)."""
        return self._stream_rng(stream, nth).randint(*self.shape.stream_prompt)

    def stream_prompt(self, stream: int, nth: int) -> Prompt:
        key = (stream, nth)
        if key not in self._streams:
            rng = self._stream_rng(stream, nth)
            n = rng.randint(*self.shape.stream_prompt)
            self._streams[key] = Prompt(prompt_text(rng, self.tokenizer, n), n, self.shape.stream_output)
        return self._streams[key]


# ----------------------------------------------------------------------------------------------------------------- #
# the real servers
# ----------------------------------------------------------------------------------------------------------------- #


def replica_cmd(args, model_dir: Path, port: int, role: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tokenfleet",
        "replica",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--threads",
        "1",
        "--kv-cache-gib",
        f"{args.kv_cache_gib:g}",
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--max-model-len",
        str(args.max_model_len),
        "--role",
        role,
        "--drain-timeout",
        "5",
    ]


def write_fleet(path: Path, model_dir: Path, port: int, replicas: list[tuple[str, str]], database: Path) -> None:
    """One model, one pool per role (the same pool name: one site), the bench tier without limits, the overload
    ladder out of reach (its shedding is not what is compared)."""
    fleet = {
        "host": "127.0.0.1",
        "port": port,
        "drain_timeout_s": 5,
        "database_url": f"sqlite:///{database}",
        "admin_key": ADMIN_KEY,
        "tiers": {BENCH_TIER: {"priority": 0, "weight": 8, "user_limits": {}, "org_limits": {}}},
        "dispatch": {"slots_per_replica": 256},
        "overload": {"ttft_target_s": 1e9},
        "models": [
            {
                "name": SERVED_NAME,
                "path": str(model_dir),
                "pools": [{"name": "near", "role": role, "replicas": [url]} for role, url in replicas],
            }
        ],
    }
    path.write_text(json.dumps(fleet, indent=1) + "\n")  # JSON is YAML


@dataclass
class Fleet:
    replicas: list[Server]
    gateway: Server
    headers: dict = field(default_factory=dict)

    @property
    def servers(self) -> list[Server]:
        return [*self.replicas, self.gateway]


def start_fleet(layout: str, args, model_dir: Path, run_dir: Path, ports) -> Fleet:
    env = repo_env(1)
    replicas = []
    for i, role in enumerate(ROLES[layout]):
        port = ports()
        log = run_dir / f"log_{layout}_replica{i}_{role}.txt"
        replicas.append(Server(f"{layout}-{role}{i}", replica_cmd(args, model_dir, port, role), port, env, log, REPO))
    gport = ports()
    config = run_dir / f"fleet_{layout}.yaml"
    write_fleet(
        config, model_dir, gport, [(r, s.base) for r, s in zip(ROLES[layout], replicas)], run_dir / f"{layout}.db"
    )
    cmd = [sys.executable, "-m", "tokenfleet", "gateway", "--config", str(config)]
    gateway = Server(f"{layout}-gateway", cmd, gport, gateway_env(args), run_dir / f"log_{layout}_gateway.txt", REPO)
    gateway.admin_key = ADMIN_KEY
    fleet = Fleet(replicas, gateway)
    for server in replicas:  # one at a time: two loading at once on 2 cores only slows both
        server.start()
        server.wait_healthy(args.start_timeout)
    gateway.start()
    gateway.wait_healthy(args.start_timeout)
    fleet.headers = auth_headers(gateway)
    return fleet


def stop_fleet(fleet: Fleet) -> None:
    for server in reversed(fleet.servers):
        server.stop(15)


KV_FAMILIES = {
    "tokenfleet:kv_transfer_bytes": "bytes",
    "tokenfleet:kv_transfer_blocks": "blocks",
    "tokenfleet:kv_transfer_seconds": "seconds",
    "tokenfleet:kv_transfers_failed": "failed",
}


def replica_counters(server: Server) -> dict[str, float]:
    """The replica's tokenfleet:kv_transfer_* counters by metric and direction (bytes_sent, blocks_received, ...),
    its engine's step time (step_s, all phases) and its own inter-token latency histogram's sum and count."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.base + "/metrics", timeout=10.0).text
    out: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        out[key] = out.get(key, 0.0) + value

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            what = KV_FAMILIES.get(family.name)
            if what is not None and sample.name.endswith("_total"):
                add(f"{what}_{sample.labels.get('direction', '?')}", sample.value)
            elif family.name == "tokenfleet:engine_step_seconds" and sample.name.endswith("_total"):
                add("step_s", sample.value)
            elif family.name == "vllm:inter_token_latency_seconds" and sample.name.endswith(("_sum", "_count")):
                add("itl_" + sample.name.rsplit("_", 1)[1], sample.value)
    return out


def counters_now(fleet: Fleet) -> list[dict[str, float]]:
    return [replica_counters(server) for server in fleet.replicas]


def counter_deltas(before: list[dict], after: list[dict], wall: float) -> dict:
    """Over the window: KV transfer totals of the fleet, each replica's engine busy share (step time / wall), and
    the replicas' own mean inter-token latency (all requests: the engine side of the client's ITL)."""
    delta = [{k: a.get(k, 0.0) - b.get(k, 0.0) for k in a} for b, a in zip(before, after)]
    kv: dict[str, float] = {}
    for replica in delta:
        for key, value in replica.items():
            if key.split("_")[0] in KV_FAMILIES.values():
                kv[key] = kv.get(key, 0.0) + value
    count = sum(d.get("itl_count", 0.0) for d in delta)
    return {
        "kv": kv,
        "engine_busy": [round(d.get("step_s", 0.0) / wall, 3) for d in delta],
        "replica_itl_mean_s": sum(d.get("itl_sum", 0.0) for d in delta) / count if count else None,
    }


def log_mentions(server: Server, *needles: str) -> int:
    """Lines of the server's log that hold every one of `needles`."""
    try:
        text = server.log.read_text(errors="replace")
    except OSError:
        return 0
    return sum(1 for line in text.splitlines() if all(n in line for n in needles))


# ----------------------------------------------------------------------------------------------------------------- #
# the client
# ----------------------------------------------------------------------------------------------------------------- #


async def one_request(client, url: str, headers: dict, prompt: Prompt, kind: str, t0: float, deadline: float) -> dict:
    body = request_body("gateway", SERVED_NAME, prompt.content, prompt.max_tokens)
    rec = await stream_request(client, url, body, deadline, headers)
    rec.update(kind=kind, content_tokens=prompt.tokens, at=rec["send"] - t0)
    return rec


async def background_stream(client, url, headers, wl: Workload, stream: int, t0: float, deadline: float) -> list:
    recs, nth = [], 0
    while time.perf_counter() - t0 < wl.shape.duration_s:
        rec = await one_request(client, url, headers, wl.stream_prompt(stream, nth), "background", t0, deadline)
        rec["stream"] = stream
        recs.append(rec)
        nth += 1
        if not rec["ok"]:
            await asyncio.sleep(0.5)  # a failing fleet: do not spin
    return recs


async def burst(client, url, headers, prompts: list[Prompt], at: float, t0: float, deadline: float) -> list:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    recs = await asyncio.gather(*(one_request(client, url, headers, p, "burst", t0, deadline) for p in prompts))
    for rec in recs:
        rec["burst_at"] = at
    return list(recs)


async def drive(base: str, headers: dict, wl: Workload, drain_s: float) -> list[dict]:
    import httpx

    url = base + "/v1/chat/completions"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wl.shape.duration_s + drain_s
    async with _client(httpx) as client:
        t0 = time.perf_counter()
        tasks = [background_stream(client, url, headers, wl, s, t0, deadline) for s in range(wl.shape.streams)]
        tasks += [burst(client, url, headers, prompts, at, t0, deadline) for at, prompts in wl.bursts]
        groups = await asyncio.gather(*tasks)
    return [rec for group in groups for rec in group]


async def warm_up(base: str, headers: dict, tokenizer, shape: Shape) -> None:
    """A short and a long request, then both at once: every path (local prefill, remote prefill, transfer) once."""
    import httpx

    url = base + "/v1/chat/completions"
    rng = random.Random("pd-split/warm-up")
    short = Prompt(prompt_text(rng, tokenizer, shape.stream_prompt[0]), shape.stream_prompt[0], 8)
    long = Prompt(prompt_text(rng, tokenizer, shape.burst_prompt[0]), shape.burst_prompt[0], 8)
    async with _client(httpx, 120.0) as client:
        for prompt in (short, long):
            rec = await one_request(client, url, headers, prompt, "warm", time.perf_counter(), None)
            if not rec["ok"]:
                raise RuntimeError(f"warm-up request failed: {rec['error']}")
        await asyncio.gather(*(one_request(client, url, headers, p, "warm", 0.0, None) for p in (short, long)))


def measure_layout(layout: str, args, model_dir: Path, run_dir: Path, wl: Workload, ports) -> dict:
    print(f"[{layout}] starting 2 replicas ({', '.join(ROLES[layout])}) and a gateway", flush=True)
    fleet = start_fleet(layout, args, model_dir, run_dir, ports)
    try:
        asyncio.run(warm_up(fleet.gateway.base, fleet.headers, wl.tokenizer, wl.shape))
        before = counters_now(fleet)
        load_before = os.getloadavg()
        probe = CpuProbe()
        probe.start()
        started = time.perf_counter()
        print(f"[{layout}] measuring {wl.shape.duration_s:g} s", flush=True)
        recs = asyncio.run(drive(fleet.gateway.base, fleet.headers, wl, args.drain))
        wall = time.perf_counter() - started
        others = probe.stop(wall)
        after = counters_now(fleet)
    finally:
        stop_fleet(fleet)
    (run_dir / f"requests_{layout}.json").write_text(json.dumps(recs, indent=1))
    row = summarize(recs)
    row.update(
        layout=layout,
        wall_s=round(wall, 1),
        others_cpu=others,
        load_before=[round(x, 2) for x in load_before],
        **counter_deltas(before, after, wall),
        roles=list(ROLES[layout]),
        prefill_fallbacks=log_mentions(fleet.gateway, "prefill on", "failed"),
        retries=log_mentions(fleet.gateway, "continuing on another replica"),
        transfer_warnings=sum(log_mentions(r, "KV transfer from") for r in fleet.replicas),
    )
    return row


# ----------------------------------------------------------------------------------------------------------------- #
# summaries
# ----------------------------------------------------------------------------------------------------------------- #


def summarize(recs: list[dict]) -> dict:
    every_gap = [g for r in recs if r["ok"] for g in r["itl"]]
    row: dict = {"itl_mean_s": statistics.fmean(every_gap) if every_gap else None}
    for kind in ("background", "burst"):
        mine = [r for r in recs if r["kind"] == kind]
        ok = [r for r in mine if r["ok"]]
        gaps = [g for r in ok for g in r["itl"]]
        ttfts = [r["ttft"] for r in ok]
        row[kind] = {
            "requests": len(mine),
            "completed": len(ok),
            "failed": len(mine) - len(ok),
            "errors": sorted({r["error"] for r in mine if r["error"]})[:3],
            "ttft_p50_s": pct(ttfts, 50),
            "ttft_p99_s": pct(ttfts, 99),
            "itl_p50_s": pct(gaps, 50),
            "itl_p99_s": pct(gaps, 99),
            "itl_p999_s": pct(gaps, 99.9),
            "itl_max_s": max(gaps, default=None),
            "gaps": len(gaps),
            "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in ok if r["prompt_tokens"])
            if any(r["prompt_tokens"] for r in ok)
            else None,
            "content_tokens_mean": statistics.fmean(r["content_tokens"] for r in ok) if ok else None,
        }
    return row


def template_tokens(rows: list[dict]) -> int:
    """What the chat template adds to a prompt's content, from the replicas' usage."""
    extra = [
        c[kind]["prompt_tokens_mean"] - c[kind]["content_tokens_mean"]
        for c in rows
        for kind in ("background", "burst")
        if c[kind]["prompt_tokens_mean"] is not None
    ]
    return round(statistics.fmean(extra)) if extra else 0


# ----------------------------------------------------------------------------------------------------------------- #
# calibration and the simulator
# ----------------------------------------------------------------------------------------------------------------- #


def calibrate(args, model_dir: Path, shape: Shape) -> dict:
    """The cost model's coefficients fitted on this machine's engine (one torch thread, the replicas' settings),
    replaying bursts of long prompts over decoding streams; and the KV link measured on loopback TCP."""
    import torch

    from tokenfleet.engine.config import EngineConfig
    from tokenfleet.engine.engine import Engine
    from tokenfleet.sim.calibration import fit, fit_error, replay

    torch.set_num_threads(1)
    engine = Engine(
        EngineConfig.from_options(
            str(model_dir),
            kv_cache_gib=args.kv_cache_gib,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
        )
    )
    vocab = engine.model_config.vocab_size
    replay(engine, calibration_arrivals(shape, vocab, warm=True), "cpu")
    measured = replay(engine, calibration_arrivals(shape, vocab), "cpu")
    coefficients = fit(measured.batches, measured.durations)
    quality = fit_error(coefficients, measured.batches, measured.durations)
    print(f"[calibration] {len(measured.durations)} steps: {quality}", flush=True)
    link = asyncio.run(loopback_link())
    return {
        "coefficients": asdict(coefficients),
        "fit": quality,
        "num_blocks": engine.blocks.num_blocks,
        "block_size": engine.config.block_size,
        "config": json.loads((model_dir / "config.json").read_text()),
        **link,
    }


def calibration_arrivals(shape: Shape, vocab: int, warm: bool = False) -> list:
    """Bursts of long prompts over decoding streams, as the workload, on the engine's CPU clock; the rounds of
    streams alternate between 1, half and all of --streams, so that the fit sees the batch sizes of both layouts
    (a colocated replica decodes about half the streams, the decode replica all of them). `warm`: a short round."""
    from tokenfleet.sim.calibration import Arrival

    rng = random.Random(f"pd-split/calibration/{warm}")
    arrivals, span = [], 2.0 if warm else max(3 * shape.burst_every_s, 12.0)
    sizes = (1, max(1, shape.streams // 2), shape.streams)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(n)]

    t, gap, rounds = 0.0, shape.stream_output * 0.012, 0  # gap: about how long a stream's request lasts
    while t < span:
        arrivals += [
            Arrival(f"s{t:g}-{i}", t, tokens(rng.randint(*shape.stream_prompt)), shape.stream_output)
            for i in range(sizes[rounds % len(sizes)])
        ]
        t, rounds = t + gap, rounds + 1
    b = 0.5
    while b < span:
        arrivals += [
            Arrival(f"b{b:g}-{i}", b, tokens(rng.randint(*shape.burst_prompt)), shape.burst_output)
            for i in range(shape.burst_size)
        ]
        b += shape.burst_every_s
    return sorted(arrivals, key=lambda a: a.at)


async def loopback_link(megabytes: int = 64, chunk: int = 1 << 20) -> dict:
    """The KV transport's framing (write_frame / read_frame) over loopback TCP: bytes/s of a stream of 1 MiB
    frames, and the round trip of a tiny frame (a transfer's open and done)."""
    from tokenfleet.replica.kv_transport import read_frame, write_frame

    async def echo(reader, writer):
        while True:
            try:
                header, _ = await read_frame(reader, 30.0)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            if header.get("op") != "blocks":
                await write_frame(writer, {"ok": True})
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    rtts = []
    for _ in range(20):
        t = time.perf_counter()
        await write_frame(writer, {"op": "ping"})
        await read_frame(reader, 30.0)
        rtts.append(time.perf_counter() - t)
    payload = os.urandom(chunk)
    t = time.perf_counter()
    for _ in range(megabytes):
        await write_frame(writer, {"op": "blocks"}, payload)
    await write_frame(writer, {"op": "done"})
    await read_frame(reader, 30.0)
    seconds = time.perf_counter() - t
    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(0.05)  # the echo side reads the end of the stream and returns
    server.close()
    await server.wait_closed()
    return {"link_bytes_per_s": megabytes * chunk / seconds, "round_trip_s": statistics.median(rtts)}


def sim_config(cal: dict, args, layout: str) -> dict:
    cfg = cal["config"]
    shape = {
        "name": "demo",
        "params": 1,  # unused: the fitted coefficients price the steps
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "num_heads": cfg["num_attention_heads"],
        "num_kv_heads": cfg["num_key_value_heads"],
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        "max_model_len": args.max_model_len,
    }
    raw = {
        "seed": 0,
        "duration_s": args.duration,
        "warmup_s": 0,
        "drain_s": args.drain,
        "fleet": {"replicas": 2, "gpu": "h100", "model": shape, "kv_dtype": "fp32", "cost": cal["coefficients"]},
        "engine": {
            "num_blocks": cal["num_blocks"],
            "block_size": cal["block_size"],
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "workload": {  # only what config checks: the benchmark sends its own requests (ScriptedMixin)
            "cancel_probability": 0,
            "max_model_len": args.max_model_len,
            "system_prompt_tokens": [1, 1],
            "max_output_tokens": 256,
        },
        "gateway": {"quota": False, "slots_per_replica": 1024, "overload": {"ttft_target_s": 1e9}},
        "routing": {"affinity": False},  # the client sends no conversation id: no affinity key, as in the real run
    }
    if layout == "disaggregated":
        raw["disagg"] = {
            "prefill_replicas": 1,
            "decode_replicas": 1,
            "link_gb_per_s": cal["link_bytes_per_s"] / 1e9,
            "link_efficiency": 1.0,
            "transfer_latency_s": 2 * cal["round_trip_s"],  # open and done
        }
    return raw


def simulate(layout: str, cal: dict, args, wl: Workload, template: int) -> dict:
    """The simulator's run of one layout on the workload: bursts at the same instants with the same prompt lengths,
    the background streams closed-loop as the client runs them."""
    from tokenfleet.sim import config
    from tokenfleet.sim.disagg import DisaggFleet
    from tokenfleet.sim.fleet import Fleet as SimFleet

    setup = config.parse_simulation(sim_config(cal, args, layout))
    base = DisaggFleet if setup.disagg is not None else SimFleet
    fleet_class = type(f"Scripted{base.__name__}", (ScriptedMixin, base), {})
    fleet = fleet_class(setup.setup, setup.disagg) if setup.disagg is not None else fleet_class(setup.setup)
    fleet.script(wl, template)
    fleet.run()
    return fleet.summary()


class ScriptedMixin:
    """A simulated fleet (Fleet or DisaggFleet) driven by this benchmark's workload instead of its conversation
    generator; it records each request's times. Short prompts skip the prefill pool, as the gateway's
    remote_prefill_min_tokens rule does (the simulator's DisaggFleet sends every prompt through it)."""

    REMOTE_PREFILL_MIN_TOKENS = 64

    def script(self, wl: Workload, template: int) -> None:
        self.wl, self.shape, self.template = wl, wl.shape, template
        self.records: dict = {}  # SimRequest -> {"kind", "stream", "client_first", "done"}
        self.next_rid = 0
        self.stream_count: dict[int, int] = {}

    def run(self):
        for stream in range(self.shape.streams):
            self.events.at(0.0, self._stream_request, stream)
        for at, prompts in self.wl.bursts:
            for prompt in prompts:
                self.events.at(at, self._send, "burst", prompt.tokens, prompt.max_tokens, None)
        self.events.at(0.0, self._load_tick)
        self.events.run(until=self.end_s)
        return self

    def _stream_request(self, stream: int) -> None:
        if self.clock.now >= self.shape.duration_s:
            return
        nth = self.stream_count.get(stream, 0)
        self.stream_count[stream] = nth + 1
        self._send("background", self.wl.stream_length(stream, nth), self.shape.stream_output, stream)

    def _send(self, kind: str, content_tokens: int, max_tokens: int, stream: int | None) -> None:
        from tokenfleet.sim.request import SimRequest
        from tokenfleet.sim.workload import block_keys

        rid = self.next_rid
        self.next_rid += 1
        base = (rid + 1) << 20  # unique token ids: no request shares a prefix with another
        prompt = list(range(base, base + content_tokens + self.template))
        output = list(range(base + (1 << 19), base + (1 << 19) + max_tokens))
        tier = "paid" if kind == "background" else "enterprise"
        sreq = SimRequest(
            f"{kind}{rid}", tier, "org", "user", 0, prompt, output, block_keys(prompt + output, 16, []), self.clock.now
        )
        self.records[sreq] = {"kind": kind, "stream": stream, "client_first": None}
        self.metrics.arrived(sreq)
        why = self.gateway.admit(sreq, self._dispatch)
        if why is not None:
            raise RuntimeError(f"the simulated gateway refused a request: {why}")

    def _dispatch(self, sreq) -> None:
        if hasattr(self, "flights") and len(sreq.prompt) < self.REMOTE_PREFILL_MIN_TOKENS:
            hashes = sreq.hashes[: len(sreq.prompt) // self.setup.spec.block_size]
            decode = self.by_name[
                self.decode_policy.choose([r.state for r in self.decode], sreq.prompt, None, hashes).replica
            ]
            decode.state.in_flight += 1
            self.in_flight += 1
            decode.add(sreq)  # the decode replica computes a short prompt itself
            return
        super()._dispatch(sreq)

    def first_token(self, stage, now: float) -> None:
        flights = getattr(self, "flights", None)
        flight = flights.get(stage) if flights is not None else None
        if flight is not None and flight.decode is not None:
            self.records[flight.sreq]["client_first"] = now  # the decode replica's first token: what our client sees
        elif stage in self.records:
            self.records[stage]["client_first"] = now
        super().first_token(stage, now)

    def finished(self, stage, now: float, reason: str) -> None:
        flights = getattr(self, "flights", None)
        if flights is not None and stage not in flights:  # a short prompt served by the decode replica alone
            from tokenfleet.sim.fleet import Fleet as SimFleet

            SimFleet.finished(self, stage, now, reason)
        else:
            super().finished(stage, now, reason)
        for sreq, rec in self.records.items():
            if rec.get("done") is None and sreq.finished is not None:
                rec["done"] = now
                if rec["kind"] == "background":
                    self.events.at(now, self._stream_request, rec["stream"])

    def summary(self) -> dict:
        out = {}
        for kind, tier in (("background", "paid"), ("burst", "enterprise")):
            mine = [(s, r) for s, r in self.records.items() if r["kind"] == kind and s.finished is not None]
            itl = self.metrics.tier(tier).itl
            out[kind] = {
                "requests": len(mine),
                "ttft_p50_s": pct([s.first_token - s.arrival for s, _ in mine], 50),
                "ttft_p99_s": pct([s.first_token - s.arrival for s, _ in mine], 99),
                "client_ttft_p50_s": pct([r["client_first"] - s.arrival for s, r in mine], 50),
                "client_ttft_p99_s": pct([r["client_first"] - s.arrival for s, r in mine], 99),
                "itl_p50_s": itl.percentile(50),
                "itl_p99_s": itl.percentile(99),
                "itl_p999_s": itl.percentile(99.9),
            }
        moved = [
            s for s in self.records if hasattr(self, "flights") and len(s.prompt) >= self.REMOTE_PREFILL_MIN_TOKENS
        ]
        out["transfers"] = getattr(self, "transfers", 0)
        out["kv_bytes"] = sum(len(s.prompt) for s in moved) * self.setup.kv_bytes_per_token  # as DisaggSpec prices it
        return out


# ----------------------------------------------------------------------------------------------------------------- #
# report
# ----------------------------------------------------------------------------------------------------------------- #


def _ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _ms1(x) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def _ratio(predicted, measured) -> str:
    return "-" if predicted is None or not measured else f"{predicted / measured:.2f}"


MEASURED_ROWS = (
    (
        "background ITL p50 / p99 / p99.9 / max (ms)",
        "background",
        ("itl_p50_s", "itl_p99_s", "itl_p999_s", "itl_max_s"),
    ),
    ("background TTFT p50 / p99 (ms)", "background", ("ttft_p50_s", "ttft_p99_s")),
    ("burst TTFT p50 / p99 (ms)", "burst", ("ttft_p50_s", "ttft_p99_s")),
    ("burst ITL p50 / p99 (ms)", "burst", ("itl_p50_s", "itl_p99_s")),
)
COMPARED = (  # (label, class, measured key, predicted key)
    ("background ITL p50 (ms)", "background", "itl_p50_s", "itl_p50_s"),
    ("background ITL p99 (ms)", "background", "itl_p99_s", "itl_p99_s"),
    ("background ITL p99.9 (ms)", "background", "itl_p999_s", "itl_p999_s"),
    ("background TTFT p50 (ms)", "background", "ttft_p50_s", "client_ttft_p50_s"),
    ("background TTFT p99 (ms)", "background", "ttft_p99_s", "client_ttft_p99_s"),
    ("burst TTFT p50 (ms)", "burst", "ttft_p50_s", "client_ttft_p50_s"),
    ("burst TTFT p99 (ms)", "burst", "ttft_p99_s", "client_ttft_p99_s"),
)


def measured_lines(rows: dict) -> list[str]:
    lines = ["| | " + " | ".join(rows) + " |", "|---|" + "---:|" * len(rows)]
    for label, kind, keys in MEASURED_ROWS:
        cells = [" / ".join(_ms(r[kind][k]) for k in keys) for r in rows.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def row(label, show):
        lines.append(f"| {label} | " + " | ".join(show(r) for r in rows.values()) + " |")

    row("requests: background / burst", lambda r: f"{r['background']['requests']} / {r['burst']['requests']}")
    row("failed: background / burst", lambda r: f"{r['background']['failed']} / {r['burst']['failed']}")
    row("ITL gaps counted (background)", lambda r: str(r["background"]["gaps"]))
    row(
        "ITL mean over all requests, client / replicas' own histogram (ms)",
        lambda r: f"{_ms1(r['itl_mean_s'])} / {_ms1(r['replica_itl_mean_s'])}",
    )
    row(
        "engine busy share per replica (step time / window)",
        lambda r: ", ".join(f"{role} {busy:.0%}" for role, busy in zip(r["roles"], r["engine_busy"])),
    )
    row(
        "KV bytes sent / received (MB)",
        lambda r: f"{r['kv'].get('bytes_sent', 0) / 1e6:.1f} / {r['kv'].get('bytes_received', 0) / 1e6:.1f}",
    )
    row(
        "KV blocks sent / received",
        lambda r: f"{r['kv'].get('blocks_sent', 0):.0f} / {r['kv'].get('blocks_received', 0):.0f}",
    )
    row(
        "KV transfer time, sender / receiver (s, summed)",
        lambda r: f"{r['kv'].get('seconds_sent', 0):.1f} / {r['kv'].get('seconds_received', 0):.1f}",
    )
    row(
        "failed transfers (counter) / prefill fallbacks (gateway log)",
        lambda r: f"{r['kv'].get('failed_sent', 0) + r['kv'].get('failed_received', 0):.0f} / {r['prefill_fallbacks']}",
    )
    row(
        "others' CPU during the window (share of all cores)",
        lambda r: "-" if r["others_cpu"] is None else f"{r['others_cpu']:.0%}",
    )
    row("load average before (1/5/15 min)", lambda r: " / ".join(f"{x:g}" for x in r["load_before"]))
    return lines


def comparison_lines(rows: dict, sims: dict) -> list[str]:
    lines = [
        "| | layout | measured | predicted | predicted / measured |",
        "|---|---|---:|---:|---:|",
    ]
    for label, kind, mkey, pkey in COMPARED:
        for layout in rows:
            measured, predicted = rows[layout][kind][mkey], sims[layout][kind][pkey]
            lines.append(f"| {label} | {layout} | {_ms(measured)} | {_ms(predicted)} | {_ratio(predicted, measured)} |")
    for layout in rows:
        measured, predicted = rows[layout]["background"]["completed"], sims[layout]["background"]["requests"]
        lines.append(
            f"| background requests completed (closed loop: throughput) | {layout} | {measured} | {predicted} | "
            f"{_ratio(predicted, measured)} |"
        )
    for layout in rows:
        measured, predicted = rows[layout]["kv"].get("bytes_sent", 0), sims[layout]["kv_bytes"]
        lines.append(
            f"| KV bytes moved (MB) | {layout} | {measured / 1e6:.1f} | {predicted / 1e6:.1f} | {_ratio(predicted, measured)} |"
        )
    return lines


def effect_lines(rows: dict, sims: dict) -> list[str]:
    """How the split changed each number (disaggregated / colocated), measured and predicted."""
    lines = ["| disaggregated / colocated | measured | predicted |", "|---|---:|---:|"]
    for label, kind, mkey, pkey in COMPARED:
        m = _ratio(rows["disaggregated"][kind][mkey], rows["colocated"][kind][mkey])
        p = _ratio(sims["disaggregated"][kind][pkey], sims["colocated"][kind][pkey])
        lines.append(f"| {label.removesuffix(' (ms)')} | {m} | {p} |")
    return lines


def render(rep: dict) -> str:
    s, cal = rep["shape"], rep["calibration"]
    c = cal["coefficients"]
    lines = [
        f"# P/D split vs colocated chunked prefill — {rep['date']}",
        "",
        f"Command: `{rep['command']}`",
        "",
        f"Machine: {rep['machine']}; git {rep['git']}. Load average before: `{rep['load_before']}`; after: "
        f"`{rep['load_after']}`. The whole run took {rep['elapsed_s']} s.",
        "",
        *[line for note in rep["notes"] for line in (f"**{note}**", "")],
        f"Checkpoint: {rep['checkpoint']}. Each layout: 2 replica processes (`--threads 1`, --kv-cache-gib "
        f"{rep['kv_cache_gib']:g}, --max-num-batched-tokens {rep['max_num_batched_tokens']}) + 1 gateway, started "
        "fresh and warmed up; colocated = 2 x `--role both`, disaggregated = 1 x `--role prefill` + 1 x `--role "
        "decode` (fleet.yaml pools with `role:`).",
        "",
        f"Workload ({s['duration_s']:g} s, seed {s['seed']}): {s['streams']} background streams, closed loop, prompts "
        f"{s['stream_prompt'][0]}-{s['stream_prompt'][1]} tokens (+{rep['template_tokens']} of chat template: under "
        f"the gateway's 64-token remote-prefill threshold, so the decode replica computes them itself) and "
        f"{s['stream_output']} output tokens each; bursts of {s['burst_size']} prompts of {s['burst_prompt'][0]}-"
        f"{s['burst_prompt'][1]} tokens ({s['burst_output']} output tokens) sent at once every "
        f"{s['burst_every_s']:g} s from t={s['first_burst_s']:g} s. Streamed chat completions through the gateway, "
        "ignore_eos, temperature 0; ITL = gaps between content chunks as the client receives them.",
        "",
        "## Measured",
        "",
        *measured_lines(rep["measured"]),
        "",
        "## Simulator (this machine's calibration) against the measurement",
        "",
        f"Calibration: {cal['fit']['steps']} engine steps replayed on the CPU clock (1 torch thread), cost model fit "
        f"mean |relative error| {cal['fit']['mean_abs_rel_error']:.1%}, predicted/measured total "
        f"{cal['fit']['total_predicted_over_measured']:.2f}; coefficients: overhead {c['overhead_s'] * 1e3:.2f} ms, "
        f"per sequence {c['per_sequence_s'] * 1e6:.0f} us, per token {c['per_token_s'] * 1e6:.1f} us, per attention "
        f"pair {c['per_attention_pair_s'] * 1e9:.2f} ns, per KV token read {c['per_kv_token_s'] * 1e9:.2f} ns. KV "
        f"link: loopback TCP with the transport's framing, {cal['link_bytes_per_s'] / 1e9:.2f} GB/s, round trip "
        f"{cal['round_trip_s'] * 1e6:.0f} us. Simulated TTFT is taken where our client sees it (disaggregated: the "
        "decode replica's first token, after the transfer); the simulator's own disaggregated TTFT (the prefill "
        f"replica's first token) for bursts: p50 {_ms(rep['simulated']['disaggregated']['burst']['ttft_p50_s'])} ms, "
        f"p99 {_ms(rep['simulated']['disaggregated']['burst']['ttft_p99_s'])} ms.",
        "",
        *comparison_lines(rep["measured"], rep["simulated"]),
        "",
        "What the split did (disaggregated over colocated; below 1: the split lowered it):",
        "",
        *effect_lines(rep["measured"], rep["simulated"]),
        "",
        "## Notes",
        "",
        "- The simulator gives each replica a core of its own (the calibration is CPU-clock time of one engine "
        "thread); here 2 replicas, the gateway and the client share the machine's cores, and other workers' load "
        "adds to that: measured wall-clock times are expected above the prediction by that contention.",
        "- The simulator does not model the gateway's and replicas' HTTP/SSE path (tokenization, relaying), nor "
        "the prefill request's HTTP round trip (POST /internal/kv/prefill) before the decode request starts.",
        "- Two differences between the simulator's `disagg:` layout (tokenfleet/sim/disagg.py) and the gateway, "
        "bridged here by the benchmark's own driver (ScriptedMixin) rather than in the simulator: the simulator "
        "sends every prompt through the prefill pool, while the gateway keeps prompts under "
        "routing.remote_prefill_min_tokens (64) uncached tokens on the decode replica; and its TTFT ends at the "
        "prefill replica's first token, while the gateway streams the first token from the decode replica after "
        "the transfer.",
        "- The layouts run one after the other (colocated first) on the same machine: a load change between them "
        "moves one layout's numbers and not the other's; compare the others' CPU rows.",
        "- The simulation is deterministic: its closed-loop streams (all of one output length) restart in step "
        "with each other and with the burst period, so whether a restart lands in a long prefill step is a matter "
        "of phase there, not of chance as on the real servers; the background TTFT tail is the least comparable "
        "number.",
        f"- Raw per-request records, server logs and the JSON of this report: the run directory `{rep['run_dir']}`.",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------- #
# command line
# ----------------------------------------------------------------------------------------------------------------- #

SHARED_MACHINE_NOTE = (
    "Numbers from a shared machine (other processes used {others} of the CPUs during a measured window; load "
    "average before the run {load}): rerun on a quiet machine with the command above before drawing conclusions."
)


def machine_notes(measured: dict, load_before: str) -> list[str]:
    """A warning when other processes competed for the CPUs (bench/_common.CONTENDED) or the machine was loaded."""
    shares = [r["others_cpu"] for r in measured.values() if r["others_cpu"] is not None]
    worst = max(shares, default=0.0)
    if worst <= CONTENDED and float(load_before.split()[0]) < (os.cpu_count() or 1):
        return []
    return [SHARED_MACHINE_NOTE.format(others=f"up to {worst:.0%}", load=f"`{load_before}`")]


def parse_args(argv=None):
    p = bench_parser(__doc__)
    add_checkpoint_args(p, "pd_split", sizes=("small", "medium", "tiny"))
    p.add_argument("--duration", type=float, default=60.0, help="measured window per layout, s (default 60)")
    p.add_argument("--drain", type=float, default=60.0, help="after the window, in-flight requests get this long")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-prompt", default="16,32", help="background prompt tokens, min,max")
    p.add_argument("--stream-output", type=int, default=160)
    p.add_argument("--burst-every", type=float, default=4.0)
    p.add_argument("--burst-size", type=int, default=4)
    p.add_argument("--burst-prompt", default="1000,1500", help="burst prompt tokens, min,max")
    p.add_argument("--burst-output", type=int, default=16)
    p.add_argument("--first-burst", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=float, default=0.5)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--port", type=int, default=FIRST_PORT, help="first port tried for the servers")
    p.add_argument("--run-dir")
    p.add_argument("--out", default="docs/benchmarks/pd_split.md", help="markdown report ('' to print only)")
    p.add_argument("--note", action="append", default=[], help="a line added to the report's notes")
    p.add_argument("--rerender", metavar="JSON", help="write the report again from a run's pd_split.json, run nothing")
    args = p.parse_args(argv)
    args.threads = 1  # served_load.gateway_env reads it
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if sorted(layouts) != sorted(LAYOUTS):
        p.error(f"--layouts: both of {', '.join(LAYOUTS)} are needed for the comparison")
    return args


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def shape_of(args) -> Shape:
    return Shape(
        duration_s=args.duration,
        streams=args.streams,
        stream_prompt=_pair(args.stream_prompt),
        stream_output=args.stream_output,
        burst_every_s=args.burst_every,
        burst_size=args.burst_size,
        burst_prompt=_pair(args.burst_prompt),
        burst_output=args.burst_output,
        first_burst_s=args.first_burst,
        seed=args.seed,
    )


def tokenfleet_dirty() -> bool:
    """Whether the checkout's tokenfleet/ has uncommitted changes (the servers ran them)."""
    import subprocess

    try:
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "tokenfleet"], capture_output=True, text=True, cwd=REPO, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return bool(status.stdout.strip())


def load_text() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def write_out(text: str, out: str) -> None:
    if out:
        path = REPO / out if not os.path.isabs(out) else Path(out)
        path.write_text(text)
        print(f"report: {path}")
    else:
        print(text)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.rerender:
        rep = json.loads(Path(args.rerender).read_text())
        rep["notes"] += args.note
        write_out(render(rep), args.out)
        return
    from tokenizers import Tokenizer

    run_dir = make_run_dir(args.run_dir, "pd-split-")
    load_before, started = load_text(), time.perf_counter()
    model_dir, source = ensure_checkpoint(args)
    shape = shape_of(args)
    wl = Workload(shape, Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    print("[calibration] fitting the cost model on this machine's engine", flush=True)
    cal = calibrate(args, model_dir, shape)
    ports = PortAllocator(args.port)
    measured = {layout: measure_layout(layout, args, model_dir, run_dir, wl, ports) for layout in LAYOUTS}
    template = template_tokens(list(measured.values()))
    simulated = {layout: simulate(layout, cal, args, wl, template) for layout in LAYOUTS}
    rep = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "nice -n 10 " + command_line(__file__),
        "machine": f"{os.cpu_count()} cores ({cpu_model()}), {memory_total()} RAM",
        "git": git_head() + (" + uncommitted changes in tokenfleet/" if tokenfleet_dirty() else ""),
        "load_before": load_before,
        "load_after": load_text(),
        "elapsed_s": round(time.perf_counter() - started),
        "checkpoint": f"{model_dir.name} ({source})",
        "kv_cache_gib": args.kv_cache_gib,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "template_tokens": template,
        "shape": asdict(shape),
        "calibration": cal,
        "measured": measured,
        "simulated": simulated,
        "run_dir": str(run_dir),
        "notes": [*machine_notes(measured, load_before), *args.note],
    }
    (run_dir / "pd_split.json").write_text(json.dumps(rep, indent=1, default=str))
    write_out(render(rep), args.out)
    print(f"run directory: {run_dir} ({rep['elapsed_s']} s)")


if __name__ == "__main__":
    main()
