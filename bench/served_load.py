#!/usr/bin/env python3
"""Served-load benchmark: tokenfleet's servers vs. vLLM's and transformers' OpenAI servers, side by side, in one run.

Run by hand, never from the test suite:

    python bench/served_load.py --size small --rates 2 --num-requests 10 --out ''          # quick check
    python bench/served_load.py --size small --rates 1,2,4,8 --num-requests 40             # report
    python bench/served_load.py --model /path/to/hf_checkpoint --systems serve,vllm ...
    python bench/served_load.py --systems serve --rates 8 --num-requests 20 --client both --out ''   # both clients
    python bench/served_load.py --preset saturation          # issue 22's table (~70 min on 2 cores, quiet machine)

Every system serves the SAME checkpoint and gets the SAME seeded workload from the SAME client, one system at a time,
each started as its own subprocess on its own loopback port (127.0.0.1 only), health-checked, warmed up, measured,
then stopped (SIGTERM to its process group, SIGKILL after --stop-timeout).  Before each system the harness waits (up
to --wait-idle s) for the CPUs to go idle (_common.cpu_busy), and every timed window records "other CPU
load" (bench/_cpuprobe.py: machine CPU time minus the benchmark process tree's -- harness, client and servers -- as a
share of all cores; above 10% the row is flagged: rerun it).

Systems (--systems, comma separated, run in this order):
  serve         `tokenfleet serve --model DIR` (gateway + in-process replica, one process).
  gateway       `tokenfleet replica --model DIR` + `tokenfleet gateway --config fleet.yaml` (two processes, HTTP between
                them; the client talks to the gateway).  The fleet file gives the gateway SQLite tenants
                (run dir/fleet.db) and an admin key; the harness makes an API key through POST /admin/v1/keys once
                the gateway is up, on an `enterprise` tier with no limits and 256 dispatch slots per replica (so
                neither quota nor fair queuing takes part), and sends it with every request to the gateway.
  vllm          vLLM CPU's OpenAI server (own venv, --vllm-python): `python -m vllm.entrypoints.openai.api_server
                --dtype float32 --enforce-eager --max-model-len min(4096, the model's window)`, VLLM_CPU_KVCACHE_SPACE=
                --kv-cache-gib, its own OpenMP binding (as in offline_throughput.py).
  transformers  `transformers serve --continuous-batching --device cpu DIR` (needs transformers[serving]).  It rejects
                the `ignore_eos` field (422 "Unexpected fields"), so its requests carry its own per-request
                `generation_config` JSON instead ({"eos_token_id": -1, "do_sample": false}: EOS never stops a request,
                which is what offline_throughput.py does for transformers CB); it ignores `stream_options` (with a
                warning) and always sends usage in its last chunk, so the field is left out for it.
tokenfleet's engine gets --kv-cache-gib too (same KV budget as vLLM); transformers keeps its own KV sizing.

Clients (--client ours|vllm|both, default ours; with both, each run of a rate goes to our client, then to vLLM's):
  ours  one asyncio client (httpx.AsyncClient, no connection limit) in this process streams POST /v1/chat/completions
        with stream=true, stream_options.include_usage, ignore_eos, temperature 0 and each request's own max_tokens.
        For each rate in --rates (req/s): --num-requests requests with Poisson arrivals (exponential gaps, seeded; the
        first at t=0); prompts are random words from a fixed word list, cut to a token length uniform in
        [--prompt-min, --prompt-max] (counted with the checkpoint's tokenizer, before the chat template adds its few
        tokens); max_tokens uniform in [--output-min, --output-max].  A rate's window ends when all its requests
        finished or at last arrival + --drain-timeout (unfinished requests count as failed).
  vllm  vLLM's own benchmark client (`vllm bench serve`: vllm.benchmarks.serve's add_cli_args + main, aiohttp) run
        from the vLLM venv (--vllm-python) in one persistent subprocess, bench/_vllm_bench_client.py (importing vLLM
        costs seconds of CPU: paid once), with `--backend openai-chat --endpoint /v1/chat/completions --dataset-name
        random --num-prompts N --request-rate RATE --ignore-eos --temperature 0 --goodput ttft:MS tpot:MS
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --save-result --save-detailed` (and
        `--header Authorization=Bearer KEY` for the gateway).  Its random dataset draws prompts of random token ids
        with a length uniform in [L x (1 - r), L x (1 + r)], L = --random-input-len minus the tokenizer's special
        tokens, and outputs likewise from --random-output-len: --prompt-min/max and --output-min/max are mapped onto L
        and r (128-384 and 32-96: L 256, so --random-input-len 257 with a tokenizer that adds a BOS;
        --random-output-len 64; --random-range-ratio 0.5); the report names the ranges it draws from.  It takes TTFT
        at the first chunk with a choice (vLLM's server sends its role-only chunk with the first token; tokenfleet
        sends role and first token in one chunk) and TPOT = (E2E - TTFT)/(output tokens - 1) as ours; the row comes
        from its result JSON (request_goodput, median/p99 of TTFT, TPOT, ITL and E2E, completed, failed, throughputs);
        "full-length outputs" compares each request's output tokens with the max tokens it asked for.  Its SSE parser
        reads every event as `data: <json>`: an `id:` line fails the request (tokenfleet sends ids only when a client
        asks).  It has no drain deadline of its own: a run that takes longer than arrivals + --drain-timeout + 120 s
        is killed and counts as failed.
The workload of a rate is identical for every system (per client).  --repeats K runs every (system, rate) K times,
each run with its own seeded workload (ours: seed string "served-load/SEED/RATE", then ".../runK"; vLLM's: --seed
crc32("served-load/SEED/RATE/runK")), so that no run finds the previous one's prompts in a prefix cache; the rows
then show the MEDIAN of each metric over the runs (others CPU and client lag: the worst run; errors: summed) and the
min-max spread of goodput and TTFT p99.

--preset saturation (issue 22's workload; any flag given explicitly overrides it): --systems serve,vllm --client
both --repeats 3 --rates 1,2,4,8,16,32,64 --num-requests 120 --prompt-min 128 --prompt-max 384 --output-min 32
--output-max 96 --slo-ttft 1 --slo-tpot 0.1 --kv-cache-gib 2 --out docs/benchmarks/served_saturation.md.

Per request: TTFT = first chunk with non-empty delta.content - send time (vLLM and transformers send a role-only chunk
first; it does not count); ITL = gaps between successive content chunks (per SSE chunk, as the client sees them: a
server that writes several events at once shows ~0 gaps); output tokens = usage.completion_tokens (the number of
content chunks if a server sends no usage); E2E = end of stream - send time; TPOT = (E2E - TTFT) / (output tokens - 1).
Per system and rate: p50/p99 of TTFT, ITL (all gaps pooled), TPOT, E2E; output tokens/s and requests/s over the
window (first send -> last end); goodput = requests/s that completed and met the SLO (TTFT <= --slo-ttft s and TPOT <=
--slo-tpot s; a 1-token request has no TPOT and is judged on TTFT only).

tokenfleet extras (with the `gateway` system):
  gateway overhead  --overhead-requests sequential requests (alternating order, short prompts, 8 output tokens), each
                    sent once to the replica's own port and once to the gateway in front of it (different prompts of
                    the same length, so prefix caching cannot favour either); TTFT p50/p99 of both and the difference
                    (target: p50 difference <= 2 ms).
  idle streams      for each N in --idle-streams: a FRESH gateway process in front of the replica, warmed up (3
                    requests), its RSS read (/proc/PID/status VmRSS); then the replica is paused (SIGSTOP on its
                    process group) and N concurrent streaming requests are opened through the gateway and held open:
                    every one is admitted (HTTP 200 + SSE headers), its relay task waits for the replica, which sends
                    nothing: this is a stream queued behind an engine that cannot take it, with no token traffic, so
                    the RSS growth is the gateway's own per-stream cost (client connection, request parsing, relay task,
                    resume-buffer entry, upstream HTTP request).  bytes/stream = (RSS with N open - RSS before) / N.
                    Also reported: the gateway->replica TCP connections open meanwhile (from /proc/net/tcp), RSS after
                    the clients disconnected; then the gateway is stopped and the replica resumed (SIGCONT).

Output: a markdown report (--out, default docs/benchmarks/served_load.md) and a JSON next to it; server logs, the
workload and the raw per-request records (ours: requests_SYSTEM.json; vLLM's client: vllm_client/*.json and its log
vllm_client.log) stay in the run directory (printed at the end).  With vLLM and a tokenfleet system in one run, the
report opens with a TTFT-vs-rate table per client, side by side (rate | goodput tokenfleet / vLLM | TTFT p50 | TTFT
p99 | TPOT p50 | others' CPU).  --keep-systems-from
REPORT.json copies the rows of the systems not run now from an earlier report (marked as such, with that run's date,
command and workload), so that e.g. a `--systems gateway` rerun still shows the comparison with the others.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import math
import os
import random
import secrets
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402  (stdlib only)
    CONTENDED,
    REPO,
    ChatStream,
    add_checkpoint_args,
    add_length_args,
    bench_parser,
    command_line,
    cpu_busy,
    known_names,
    make_run_dir,
    package_versions,
    pct,
    prompt_text,
    repo_env,
    report_to_rerender,
    wait_idle,
)
from _cpuprobe import CpuProbe  # noqa: E402  (stdlib only)
from offline_throughput import checkpoint_info, ensure_checkpoint, machine_info  # noqa: E402  (stdlib only at import time)

ALL_SYSTEMS = ["serve", "gateway", "vllm", "transformers"]
CLIENT_LAG = 0.05  # a request sent this much later than scheduled: the client itself was starved of CPU
LABELS = {
    "serve": "tokenfleet serve (embedded)",
    "gateway": "tokenfleet gateway + replica",
    "vllm": "vLLM CPU OpenAI server",
    "transformers": "transformers serve --continuous-batching",
}
SERVED_NAME = "bench"
PRESETS = {
    "saturation": {  # issue 22: time to first token when the burst comes, tokenfleet serve vs vLLM-CPU
        "systems": "serve,vllm",
        "client": "both",
        "repeats": 3,
        "rates": "1,2,4,8,16,32,64",
        "num_requests": 120,
        "prompt_min": 128,
        "prompt_max": 384,
        "output_min": 32,
        "output_max": 96,
        "slo_ttft": 1.0,
        "slo_tpot": 0.1,
        "kv_cache_gib": 2.0,
        "out": "docs/benchmarks/served_saturation.md",
    }
}


# ----------------------------------------------------------------------------------------------------------------- #
# workload
# ----------------------------------------------------------------------------------------------------------------- #


def run_seed(seed: int, rate: float, run: int) -> str:
    """The seed of one run of a rate: run 1 keeps the seed the workload always had (before --repeats)."""
    return f"served-load/{seed}/{rate:g}" + (f"/run{run}" if run > 1 else "")


def vllm_client_seed(seed: int, rate: float, run: int) -> int:
    """vLLM's client's --seed for one run of a rate (an int: it seeds numpy)."""
    return zlib.crc32(f"served-load/{seed}/{rate:g}/run{run}".encode())


def rate_requests(args, tok, rng: random.Random, rate: float) -> list[dict]:
    t, reqs = 0.0, []
    for i in range(args.num_requests):
        if i:
            t += rng.expovariate(rate)
        plen = rng.randint(args.prompt_min, args.prompt_max)
        reqs.append(
            {
                "arrival": t,
                "content": prompt_text(rng, tok, plen),
                "content_tokens": plen,
                "max_tokens": rng.randint(args.output_min, args.output_max),
            }
        )
    return reqs


def make_workload(args, model_dir: Path, rates: list[float], repeats: int = 1) -> dict:
    """Our client's requests: "rates" holds each rate's first run, "repeats" its runs 2..repeats."""
    from tokenizers import Tokenizer  # light (no torch)

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    per_rate, more = {}, {}
    for rate in rates:
        runs = [
            rate_requests(args, tok, random.Random(run_seed(args.seed, rate, k)), rate)  # str seeds: sha512
            for k in range(1, repeats + 1)
        ]
        per_rate[f"{rate:g}"], more[f"{rate:g}"] = runs[0], runs[1:]
    rng = random.Random(f"served-load/{args.seed}/warmup")
    warm = [{"content": prompt_text(rng, tok, n), "max_tokens": 16} for n in (16, 500, 64, 128, 256, 32, 400, 200)]
    rng = random.Random(f"served-load/{args.seed}/overhead")
    overhead = []
    for _ in range(args.overhead_requests + 4):
        n = rng.randint(32, 96)
        overhead.append({"direct": prompt_text(rng, tok, n), "gateway": prompt_text(rng, tok, n), "max_tokens": 8})
    idle = prompt_text(random.Random(f"served-load/{args.seed}/idle"), tok, 32)
    return {
        "seed": args.seed,
        "rates": per_rate,
        "repeats": more,
        "warmup": warm,
        "overhead": overhead,
        "idle_prompt": idle,
    }


def rate_runs(wl: dict, rate_key: str) -> list[list[dict]]:
    """Our client's requests of every run of a rate, run 1 first."""
    return [wl["rates"][rate_key]] + wl.get("repeats", {}).get(rate_key, [])


# ----------------------------------------------------------------------------------------------------------------- #
# client
# ----------------------------------------------------------------------------------------------------------------- #


def request_body(system: str, model: str, content: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if system == "transformers":
        # transformers serve answers 422 to `ignore_eos` and ignores stream_options (usage is always sent);
        # its own per-request generation_config does ignore-EOS (eos_token_id=-1).
        del body["ignore_eos"], body["stream_options"]
        body["generation_config"] = json.dumps({"eos_token_id": -1, "do_sample": False})
    return body


async def stream_request(
    client, url: str, body: dict, deadline: float | None = None, headers: dict | None = None
) -> dict:
    """One streamed chat completion; deadline is in loop time (asyncio.get_running_loop().time())."""
    rec: dict = {"max_tokens": body["max_tokens"]}
    stream, err = ChatStream(), None
    send = time.perf_counter()
    try:
        async with asyncio.timeout_at(deadline):
            async with client.stream("POST", url, json=body, headers=headers) as r:
                rec["request_id"] = r.headers.get("x-request-id")  # tokenfleet's gateway names every request
                err = await stream.read(r)
    except TimeoutError:
        err = "timed out (window limit)"
    except Exception as e:  # noqa: BLE001  (connection errors etc.: the request failed)
        err = f"{e.__class__.__name__}: {e}"[:300]
    end = time.perf_counter()
    content_t, usage, finish = [t for t, _ in stream.content], stream.usage, stream.finish
    out = (usage or {}).get("completion_tokens")
    rec.update(
        send=send,
        end=end,
        e2e=end - send,
        chunks=len(content_t),
        finish=finish,
        prompt_tokens=(usage or {}).get("prompt_tokens"),
        usage=usage is not None,
        output_tokens=out if out is not None else len(content_t),
    )
    rec["ttft"] = content_t[0] - send if content_t else None
    rec["itl"] = [b - a for a, b in zip(content_t, content_t[1:])]
    rec["ok"] = err is None and rec["ttft"] is not None
    n = rec["output_tokens"]
    rec["tpot"] = (rec["e2e"] - rec["ttft"]) / (n - 1) if rec["ok"] and n > 1 else None
    rec["error"] = err if err is not None or rec["ok"] else "no content chunk"
    return rec


def _client(httpx, timeout: float | None = 600.0):
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def run_rate(
    system: str, base: str, model: str, reqs: list[dict], drain_timeout: float, headers: dict | None = None
) -> tuple[list, float]:
    import httpx

    url = base + "/v1/chat/completions"
    loop = asyncio.get_running_loop()
    async with _client(httpx) as client:
        t0 = time.perf_counter() + 0.05
        deadline = loop.time() + 0.05 + reqs[-1]["arrival"] + drain_timeout
        tasks = []
        for rq in reqs:
            delay = t0 + rq["arrival"] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = request_body(system, model, rq["content"], rq["max_tokens"])
            tasks.append(asyncio.create_task(stream_request(client, url, body, deadline, headers)))
        recs = await asyncio.gather(*tasks)
    for rq, rec in zip(reqs, recs):
        rec["lag"] = rec["send"] - (t0 + rq["arrival"])  # how late the client sent it (should be ~0)
        rec["content_tokens"] = rq["content_tokens"]
    wall = max(r["end"] for r in recs) - t0
    return list(recs), wall


async def run_warmup(system: str, base: str, model: str, warm: list[dict], headers: dict | None = None) -> list[dict]:
    """Two sequential requests, then the rest concurrently (first requests may trigger lazy initialization)."""
    import httpx

    url = base + "/v1/chat/completions"
    deadline = asyncio.get_running_loop().time() + 600
    async with _client(httpx) as client:
        recs = [
            await stream_request(
                client, url, request_body(system, model, w["content"], w["max_tokens"]), deadline, headers
            )
            for w in warm[:2]
        ]
        recs += await asyncio.gather(
            *[
                stream_request(
                    client, url, request_body(system, model, w["content"], w["max_tokens"]), deadline, headers
                )
                for w in warm[2:]
            ]
        )
    return recs


def summarize(recs: list[dict], wall: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in recs if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    itl = [g for r in ok for g in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    good = [r for r in ok if r["ttft"] <= slo_ttft and (r["tpot"] is None or r["tpot"] <= slo_tpot)]
    out_tokens = sum(r["output_tokens"] for r in ok)
    errors: dict[str, int] = {}
    for r in recs:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    s = {
        "requests": len(recs),
        "completed": len(ok),
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall if wall > 0 else 0.0,
        "req_s": len(ok) / wall if wall > 0 else 0.0,
        "good": len(good),
        "goodput_rps": len(good) / wall if wall > 0 else 0.0,
        "good_frac": len(good) / len(recs) if recs else 0.0,
        "full_length": sum(1 for r in ok if r["output_tokens"] == r["max_tokens"]),
        "chunks_per_token": (sum(r["chunks"] for r in ok) / out_tokens) if out_tokens else None,
        "mean_prompt_tokens": statistics.mean(r["prompt_tokens"] for r in ok)
        if ok and all(r["prompt_tokens"] is not None for r in ok)
        else None,
        "max_client_lag_s": max((r.get("lag", 0.0) for r in recs), default=0.0),
        "errors": errors,
    }
    for name, xs in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        s[f"{name}_p50"], s[f"{name}_p99"] = pct(xs, 50), pct(xs, 99)
        s[f"{name}_mean"] = statistics.mean(xs) if xs else None
    return s


SPREAD_KEYS = ("goodput_rps", "ttft_p99")  # shown as min-max over the runs of a rate
WORST_KEYS = ("others_cpu", "max_client_lag_s", "cpu_busy_before")  # the worst run's value, not the median


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def combine_runs(runs: list[dict]) -> dict:
    """One row for the runs of a (system, rate): the median of each metric (others CPU, client lag: the worst run;
    errors: summed), the min-max of goodput and TTFT p99 ("spread") and each run's headline numbers ("per_run")."""
    row: dict = {}
    for key in runs[0]:
        values = [r.get(key) for r in runs]
        known = [v for v in values if v is not None]
        if key == "errors":
            merged: dict[str, int] = {}
            for errors in values:
                for msg, n in (errors or {}).items():
                    merged[msg] = merged.get(msg, 0) + n
            row[key] = merged
        elif not known or not all(_is_number(v) for v in known):
            row[key] = values[0]
        elif key in WORST_KEYS:
            row[key] = max(known)
        else:
            row[key] = statistics.median(known)
    row["runs"] = len(runs)
    row["spread"] = {
        key: [min(vs), max(vs)] if (vs := [r[key] for r in runs if r.get(key) is not None]) else None
        for key in SPREAD_KEYS
    }
    row["per_run"] = [
        {k: r.get(k) for k in ("completed", "goodput_rps", "ttft_p50", "ttft_p99", "tpot_p50", "others_cpu")}
        for r in runs
    ]
    return row


# ----------------------------------------------------------------------------------------------------------------- #
# vLLM's benchmark client (`vllm bench serve`), in the vLLM venv
# ----------------------------------------------------------------------------------------------------------------- #

VLLM_CLIENT_START_TIMEOUT = 300.0
VLLM_CLIENT_SLACK = 120.0  # a run's limit beyond arrivals + --drain-timeout (its tokenizer, its dataset)


def vllm_length_args(low: int, high: int) -> tuple[int, float]:
    """(mean, range ratio) with which vLLM's random dataset draws a length uniform in [low, high] (exactly when
    low + high is even; floor/ceil of a float product may miss by one, so the ratio shrinks by a hair then)."""
    mean = round((low + high) / 2)
    ratio = (high - low) / (2 * mean)
    return mean, ratio if vllm_drawn_range(mean, ratio) == (low, high) else ratio - 1e-9


def vllm_drawn_range(mean: int, ratio: float) -> tuple[int, int]:
    """The lengths vLLM's random dataset draws from, by its own formula (vllm/benchmarks/datasets/utils.py)."""
    return math.floor(mean * (1 - ratio)), max(1, math.ceil(mean * (1 + ratio)))


def vllm_workload_args(args, special_tokens: int) -> dict:
    """The flags that give vLLM's client our prompt and output length ranges, and the ranges it then draws from."""
    lin, rin = vllm_length_args(args.prompt_min, args.prompt_max)
    lout, rout = vllm_length_args(args.output_min, args.output_max)
    return {
        "random_input_len": lin + special_tokens,  # it subtracts the tokenizer's special tokens first
        "random_output_len": lout,
        "random_range_ratio": repr(rin) if rin == rout else json.dumps({"input": rin, "output": rout}),
        "input_range": vllm_drawn_range(lin, rin),
        "output_range": vllm_drawn_range(lout, rout),
    }


class VllmClient:
    """vLLM's benchmark client in one persistent subprocess of the vLLM venv (bench/_vllm_bench_client.py): each
    run is one JSON line to it and one back; a run it must be killed in leaves it to be started again."""

    def __init__(self, python: str, tokenizer_dir: Path, log: Path) -> None:
        self.python, self.tokenizer_dir, self.log = python, tokenizer_dir, log
        self.proc: subprocess.Popen | None = None
        self.ready: dict = {}
        self._pending = b""

    def start(self) -> dict:
        """Starts it (importing vLLM takes a while); returns its ready line (vllm version, num_special_tokens)."""
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        for name in ("PYTHONPATH", "OPENAI_API_KEY"):  # its own packages; its key would go into every request
            env.pop(name, None)
        self._logf = open(self.log, "a")
        self.proc = subprocess.Popen(
            [self.python, str(HERE / "_vllm_bench_client.py"), str(self.tokenizer_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._logf,
            env=env,
            cwd=self.log.parent,
            start_new_session=True,
        )
        self._pending = b""
        self.ready = self._reply(VLLM_CLIENT_START_TIMEOUT)
        return self.ready

    def run(self, argv: list[str], timeout: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self.start()
        self.proc.stdin.write((json.dumps({"argv": argv}) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._reply(timeout)
        if not reply.get("ok"):
            raise RuntimeError(reply.get("error") or reply)

    def _reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise TimeoutError(f"no answer in {timeout:.0f} s (killed)")
            if select.select([fd], [], [], left)[0]:
                data = os.read(fd, 65536)
                if not data:
                    self.close()
                    raise RuntimeError(f"it exited; its log ({self.log}) ends: {_tail(self.log)}")
                self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()  # its loop ends at end of input
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)
        self._logf.close()
        self.proc = None


def _tail(log: Path, n: int = 3) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-n:])[-600:]
    except OSError:
        return ""


def vllm_client_argv(args, served: Served, rate: float, run: int, result: Path, special_tokens: int) -> list[str]:
    """`vllm bench serve` flags for one run of a rate against `served`."""
    w = vllm_workload_args(args, special_tokens)
    argv = [
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        served.base,
        "--model",
        served.model,
        "--tokenizer",
        str(served.model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(w["random_input_len"]),
        "--random-output-len",
        str(w["random_output_len"]),
        "--random-range-ratio",
        w["random_range_ratio"],
        "--num-prompts",
        str(args.num_requests),
        "--request-rate",
        f"{rate:g}",
        "--seed",
        str(vllm_client_seed(args.seed, rate, run)),
        "--ignore-eos",
        "--temperature",
        "0",
        "--goodput",
        f"ttft:{1e3 * args.slo_ttft:g}",
        f"tpot:{1e3 * args.slo_tpot:g}",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--request-id-prefix",  # unique per run: a server may keep ids it saw
        f"vllm-client-{served.system}-{rate:g}-run{run}-{secrets.token_hex(3)}-",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]
    if served.headers:
        argv += ["--header"] + [f"{k}={v}" for k, v in served.headers.items()]
    return argv


def vllm_client_summary(res: dict) -> dict:
    """Our row's fields from vLLM's client's result JSON (times in s; its own figures, not recomputed)."""
    n, ok, wall = res.get("num_prompts", 0), res.get("completed", 0), res.get("duration") or 0.0
    goodput = res.get("request_goodput") or 0.0
    errors: dict[str, int] = {}
    for e in res.get("errors") or []:
        if e:
            msg = e.strip().splitlines()[-1][:200]
            errors[msg] = errors.get(msg, 0) + 1
    out, expected = res.get("output_lens"), res.get("expected_output_lens")
    s = {
        "requests": n,
        "completed": ok,
        "failed": res.get("failed", n - ok),
        "wall_s": wall,
        "output_tokens": res.get("total_output_tokens", 0),
        "output_tok_s": res.get("output_throughput", 0.0),
        "req_s": res.get("request_throughput", 0.0),
        "good": round(goodput * wall),
        "goodput_rps": goodput,
        "good_frac": round(goodput * wall) / n if n else 0.0,
        "full_length": sum(1 for o, x in zip(out, expected) if o == x) if out and expected else None,
        "mean_prompt_tokens": res["total_input_tokens"] / ok if ok else None,  # from usage: chat template included
        "mean_output_tokens": res["total_output_tokens"] / ok if ok else None,
        "max_client_lag_s": None,
        "errors": errors,
    }
    for name, theirs in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2e", "e2el")):
        for stat, key in (("p50", f"median_{theirs}_ms"), ("p99", f"p99_{theirs}_ms"), ("mean", f"mean_{theirs}_ms")):
            s[f"{name}_{stat}"] = res[key] / 1e3 if ok and res.get(key) is not None else None  # it says 0 for none
    return s


def vllm_client_run(client: VllmClient, args, served: Served, rate: float, run: int, run_dir: Path) -> dict:
    result = run_dir / "vllm_client" / f"{served.system}_rate{rate:g}_run{run}.json"
    result.parent.mkdir(exist_ok=True)
    argv = vllm_client_argv(args, served, rate, run, result, client.ready.get("num_special_tokens", 0))
    try:
        client.run(argv, args.num_requests / rate + args.drain_timeout + VLLM_CLIENT_SLACK)
        return vllm_client_summary(json.loads(result.read_text()))
    except Exception as e:  # noqa: BLE001  (the run failed; the next one starts it again)
        err = f"vLLM's client: {e.__class__.__name__}: {e}"[:300]
        return vllm_client_summary({"num_prompts": args.num_requests, "errors": [err] * args.num_requests})


# ----------------------------------------------------------------------------------------------------------------- #
# servers
# ----------------------------------------------------------------------------------------------------------------- #


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class PortAllocator:
    def __init__(self, start: int) -> None:
        self.next = start

    def __call__(self) -> int:
        while not port_free(self.next):
            self.next += 1
        self.next += 1
        return self.next - 1


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    data = f.read()
                ppid = int(data[data.rfind(")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    return kids


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for ln in f:
                if ln.startswith("VmRSS:"):
                    return int(ln.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def tree_rss(pid: int) -> int:
    kids, total, todo = _children(), 0, [pid]
    while todo:
        p = todo.pop()
        total += rss_bytes(p) or 0
        todo.extend(kids.get(p, []))
    return total


class Server:
    """One server subprocess in its own session/process group (so stopping it stops its children too)."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict, log: Path, cwd: Path) -> None:
        self.name, self.cmd, self.port, self.env, self.log, self.cwd = name, cmd, port, env, log, cwd
        self.proc: subprocess.Popen | None = None
        self.base = f"http://127.0.0.1:{port}"
        self.admin_key: str | None = None  # a tokenfleet gateway: every request needs an API key made with this

    def start(self) -> None:
        self._logf = open(self.log, "w")
        self._logf.write("$ " + " ".join(shlex.quote(c) for c in self.cmd) + "\n")
        self._logf.flush()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd, start_new_session=True
        )

    def log_tail(self, n: int = 12) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").strip().splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float) -> float:
        import httpx

        t = time.perf_counter()
        while time.perf_counter() - t < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited (rc={self.proc.returncode}) before becoming healthy:\n" + self.log_tail()
                )
            try:
                if httpx.get(self.base + "/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - t
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f}s:\n" + self.log_tail())

    def signal_group(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float) -> str:
        if self.proc is None:
            return "not started"
        how = "exited"
        if self.proc.poll() is None:
            self.signal_group(signal.SIGCONT)  # in case it was paused
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
                how = "SIGTERM"
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.proc.wait(10)
                how = "SIGKILL"
        try:  # leftover children of the group (e.g. vLLM's engine core) get SIGKILL
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._logf.close()
        return how


def tokenfleet_cmd(sub: str, args, model_dir: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tokenfleet",
        sub,
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
        "--drain-timeout",
        "5",
    ] + shlex.split(args.tokenfleet_args)


ADMIN_KEY = "bench-admin-" + secrets.token_hex(16)  # guards the bench gateways' /admin/v1 (loopback only)
BENCH_TIER = "enterprise"


def write_fleet_yaml(
    path: Path, model_dir: Path, port: int, replica_port: int, database: Path, extra: dict | None = None
) -> None:
    """The gateway needs tenants (SQLite here) and an admin key. The bench tier has no limits (a tier given here
    replaces the default whole) and the dispatcher enough slots, so neither quota nor queueing takes part in the
    comparison: what is measured is the gateway's own per-request work. `extra`: settings added or replaced
    (another benchmark's database_url, redis_url, ...)."""
    fleet = {
        "model_name": SERVED_NAME,
        "model_path": str(model_dir),
        "host": "127.0.0.1",
        "port": port,
        "replicas": [f"http://127.0.0.1:{replica_port}"],
        "drain_timeout_s": 5,
        "database_url": f"sqlite:///{database}",
        "admin_key": ADMIN_KEY,
        "tiers": {BENCH_TIER: {"priority": 0, "weight": 8, "user_limits": {}, "org_limits": {}}},
        "dispatch": {"slots_per_replica": 256},
    }
    path.write_text(json.dumps({**fleet, **(extra or {})}, indent=1) + "\n")  # JSON is YAML


def gateway_env(args) -> dict:
    env = repo_env(args.threads)
    for name in ("TOKENFLEET_ADMIN_KEY", "TOKENFLEET_DATABASE_URL"):  # these would override the fleet file
        env.pop(name, None)
    return env


def auth_headers(server: Server) -> dict:
    """{} for a server without keys; for a gateway, a new API key of the bench tier (made through /admin/v1)."""
    if server.admin_key is None:
        return {}
    import httpx

    r = httpx.post(
        server.base + "/admin/v1/keys",
        json={"org": "bench", "user": "bench", "tier": BENCH_TIER},
        headers={"Authorization": f"Bearer {server.admin_key}"},
        timeout=30.0,
    )
    if not r.is_success:
        raise RuntimeError(f"creating an API key failed: HTTP {r.status_code}: {r.text[:300]}")
    return {"Authorization": f"Bearer {r.json()['key']}"}


def build_servers(system: str, args, model_dir: Path, max_len: int, run_dir: Path, ports) -> tuple[list[Server], str]:
    """(servers in start order -- the last one is the client's target --, model name the client sends)."""
    env = repo_env(args.threads)
    if system == "serve":
        p = ports()
        return [
            Server("serve", tokenfleet_cmd("serve", args, model_dir, p), p, env, run_dir / "log_serve.txt", run_dir)
        ], SERVED_NAME
    if system == "gateway":
        rp, gp = ports(), ports()
        cfg = run_dir / "fleet.yaml"
        write_fleet_yaml(cfg, model_dir, gp, rp, run_dir / "fleet.db")
        replica = Server(
            "replica",
            tokenfleet_cmd("replica", args, model_dir, rp),
            rp,
            env,
            run_dir / "log_gateway_replica.txt",
            run_dir,
        )
        gateway = Server(
            "gateway",
            [sys.executable, "-m", "tokenfleet", "gateway", "--config", str(cfg)],
            gp,
            gateway_env(args),
            run_dir / "log_gateway_gateway.txt",
            run_dir,
        )
        gateway.admin_key = ADMIN_KEY
        return [replica, gateway], SERVED_NAME
    if system == "vllm":
        if not Path(args.vllm_python).exists():
            raise FileNotFoundError(f"vLLM python {args.vllm_python} not found (run bench/setup_peers.sh)")
        p = ports()
        venv = dict(env)
        venv["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
        venv.pop("OMP_NUM_THREADS", None)  # vLLM binds its OpenMP threads itself (see offline_throughput.py)
        venv.pop("MKL_NUM_THREADS", None)
        venv.pop("PYTHONPATH", None)
        cmd = [
            args.vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(p),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(max_len),
            "--served-model-name",
            SERVED_NAME,
            "--seed",
            "0",
        ] + shlex.split(args.vllm_args)
        return [Server("vllm", cmd, p, venv, run_dir / "log_vllm.txt", run_dir)], SERVED_NAME
    if system == "transformers":
        exe = shutil.which("transformers")
        if exe is None:
            raise FileNotFoundError("no `transformers` command (pip install 'transformers[serving]')")
        p = ports()
        cmd = (
            [
                exe,
                "serve",
                "--continuous-batching",
                "--device",
                "cpu",
                "--host",
                "127.0.0.1",
                "--port",
                str(p),
                "--log-level",
                "warning",
            ]
            + shlex.split(args.transformers_args)
            + [str(model_dir)]
        )
        return [Server("transformers", cmd, p, env, run_dir / "log_transformers.txt", run_dir)], str(model_dir)
    raise ValueError(system)


# ----------------------------------------------------------------------------------------------------------------- #
# tokenfleet extras: gateway overhead, idle streams
# ----------------------------------------------------------------------------------------------------------------- #


async def gateway_overhead(replica: str, gateway: str, pairs: list[dict], headers: dict) -> dict:
    """`headers` (the API key) go to the gateway only; the replica takes no key."""
    import httpx

    recs = {"direct": [], "gateway": []}
    deadline = asyncio.get_running_loop().time() + 300
    async with _client(httpx) as client:
        for i, pair in enumerate(pairs):
            order = ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")
            for target in order:
                base = replica if target == "direct" else gateway
                body = request_body("gateway", SERVED_NAME, pair[target], pair["max_tokens"])
                rec = await stream_request(
                    client, base + "/v1/chat/completions", body, deadline, headers if target == "gateway" else None
                )
                if i >= 4:  # the first 4 pairs warm up both paths (connections, code)
                    recs[target].append(rec)
                await asyncio.sleep(0.05)
    res: dict = {"pairs": len(pairs) - 4}
    for target, rs in recs.items():
        ok = [r for r in rs if r["ok"]]
        res[target] = {
            "completed": len(ok),
            "ttft_p50": pct([r["ttft"] for r in ok], 50),
            "ttft_p99": pct([r["ttft"] for r in ok], 99),
            "e2e_p50": pct([r["e2e"] for r in ok], 50),
            "itl_p50": pct([g for r in ok for g in r["itl"]], 50),
            "errors": sorted({r["error"] for r in rs if not r["ok"]}),
        }
    d, g = res["direct"], res["gateway"]
    for k in ("ttft_p50", "ttft_p99", "e2e_p50", "itl_p50"):
        res[f"added_{k}"] = (g[k] - d[k]) if g[k] is not None and d[k] is not None else None
    paired = [gr["ttft"] - dr["ttft"] for dr, gr in zip(recs["direct"], recs["gateway"]) if dr["ok"] and gr["ok"]]
    res["added_ttft_paired_median"] = statistics.median(paired) if paired else None
    return res


def process_cpu_s(pid: int) -> float:
    """User + system CPU time of one process so far, seconds (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gateway_idle_cpu(pid: int, seconds: float = 3.0) -> float:
    """CPU seconds per second the gateway uses with no requests (its load polls, health checks, metering loops)."""
    cpu = process_cpu_s(pid)
    time.sleep(seconds)
    return (process_cpu_s(pid) - cpu) / seconds


def upstream_connections(port: int) -> int:
    """ESTABLISHED TCP connections whose remote end is 127.0.0.1:port (i.e. opened towards the replica)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if len(f) > 3 and f[3] == "01" and int(f[2].rsplit(":", 1)[1], 16) == port:
                n += 1
    return n


async def hold_streams(
    gateway: Server, replica_port: int, model: str, prompt: str, n: int, open_timeout: float, headers: dict
) -> dict:
    import httpx

    url = gateway.base + "/v1/chat/completions"
    body = request_body("gateway", model, prompt, 16)
    opened, failed = [0], {}
    all_in, release = asyncio.Event(), asyncio.Event()

    async def one(client) -> None:
        try:
            async with client.stream("POST", url, json=body, headers=headers) as r:
                if r.status_code == 200:
                    opened[0] += 1
                else:
                    k = f"HTTP {r.status_code}"
                    failed[k] = failed.get(k, 0) + 1
                if opened[0] + sum(failed.values()) == n:
                    all_in.set()
                await release.wait()  # hold the stream open without reading it
        except Exception as e:  # noqa: BLE001
            k = e.__class__.__name__
            failed[k] = failed.get(k, 0) + 1
            if opened[0] + sum(failed.values()) == n:
                all_in.set()

    pid = gateway.proc.pid
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=60.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
    )
    t = time.perf_counter()
    tasks = [asyncio.create_task(one(client)) for _ in range(n)]
    try:
        await asyncio.wait_for(all_in.wait(), open_timeout)
    except TimeoutError:
        pass
    open_s = time.perf_counter() - t
    # let the gateway settle (relay tasks reach their upstream wait), then read RSS until it stops changing
    samples = []
    for _ in range(12):
        await asyncio.sleep(0.5)
        samples.append(rss_bytes(pid) or 0)
        if len(samples) >= 4 and max(samples[-4:]) - min(samples[-4:]) < 0.002 * samples[-1]:
            break
    res = {
        "n": n,
        "opened": opened[0],
        "failed": dict(failed),
        "open_s": open_s,
        "rss_open": samples[-1],
        "rss_open_max": max(samples),
        "upstream_connections": upstream_connections(replica_port),
        "gateway_alive": gateway.proc.poll() is None,
    }
    release.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.aclose()
    return res


def log_errors(log: Path) -> tuple[int, str | None]:
    """(number of tracebacks in a server log, the last exception line)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return 0, None
    last = None
    for i, ln in enumerate(lines):
        if ln.startswith("Traceback"):
            last = next((x for x in lines[i + 1 :] if x and not x.startswith(" ")), None)
    return sum(1 for ln in lines if ln.startswith("Traceback")), last


def idle_streams_phase(args, model_dir: Path, replica: Server, prompt: str, run_dir: Path, ports) -> list[dict]:
    out = []
    for n in args.idle_streams:
        gp = ports()
        cfg = run_dir / f"fleet_idle_{n}.yaml"
        write_fleet_yaml(cfg, model_dir, gp, replica.port, run_dir / "fleet.db")  # the main gateway's tenants
        gw = Server(
            f"gateway-idle-{n}",
            [sys.executable, "-m", "tokenfleet", "gateway", "--config", str(cfg)],
            gp,
            gateway_env(args),
            run_dir / f"log_gateway_idle_{n}.txt",
            run_dir,
        )
        gw.admin_key = ADMIN_KEY
        row: dict = {"n": n}
        try:
            gw.start()
            gw.wait_healthy(args.start_timeout)
            headers = auth_headers(gw)
            warm = asyncio.run(
                run_warmup("gateway", gw.base, SERVED_NAME, [{"content": prompt, "max_tokens": 16}] * 3, headers)
            )
            if not all(r["ok"] for r in warm):
                raise RuntimeError(f"warm-up failed: {[r['error'] for r in warm if not r['ok']]}")
            time.sleep(1.0)
            row["rss_before"] = rss_bytes(gw.proc.pid)
            replica.signal_group(signal.SIGSTOP)
            try:
                row.update(
                    asyncio.run(hold_streams(gw, replica.port, SERVED_NAME, prompt, n, args.idle_open_timeout, headers))
                )
                time.sleep(args.idle_after_wait)
                row["rss_after_close"] = rss_bytes(gw.proc.pid)
            finally:
                gw.stop(args.stop_timeout)
                replica.signal_group(signal.SIGCONT)
            row["log_tracebacks"], row["log_last_error"] = log_errors(gw.log)
            row["bytes_per_stream"] = (
                (row["rss_open"] - row["rss_before"]) / row["opened"] if row.get("opened") else None
            )
            print(
                f"[idle streams] N={n}: opened {row['opened']} (failed {row['failed']}) in {row['open_s']:.1f}s; "
                f"gateway RSS {row['rss_before'] / 2**20:.1f} -> {row['rss_open'] / 2**20:.1f} MiB"
                + (f" = {row['bytes_per_stream'] / 1024:.1f} KiB/stream" if row["bytes_per_stream"] else "")
                + f"; {row['upstream_connections']} gateway->replica connections; RSS "
                f"{args.idle_after_wait:g}s after the clients left {row['rss_after_close'] / 2**20:.1f} MiB; "
                f"{row['log_tracebacks']} tracebacks in the gateway log ({row['log_last_error']})",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{e.__class__.__name__}: {e}"[:500]
            print(f"[idle streams] N={n} FAILED: {row['error']}", flush=True)
            gw.stop(args.stop_timeout)
            replica.signal_group(signal.SIGCONT)
        out.append(row)
        time.sleep(2.0)  # the resumed replica handles the abandoned upstream requests
    return out


# ----------------------------------------------------------------------------------------------------------------- #
# one system
# ----------------------------------------------------------------------------------------------------------------- #


@dataclass
class Served:
    """A system under test as the clients see it: its servers (the last one takes the requests), the model name they
    send, the headers they send (a gateway's API key) and the checkpoint (vLLM's client reads its tokenizer)."""

    system: str
    servers: list[Server]
    model: str
    model_dir: Path
    headers: dict

    @property
    def base(self) -> str:
        return self.servers[-1].base


CLIENT_TAGS = {"ours": "our client", "vllm": "vLLM's client"}


def in_window(work, *work_args):
    """work(*work_args) in a timed window: (its result, other processes' CPU share meanwhile, how busy the machine
    was just before)."""
    busy = cpu_busy(0.5)
    probe = CpuProbe()
    probe.start()
    t = time.perf_counter()
    result = work(*work_args)
    return result, probe.stop(time.perf_counter() - t), busy


def run_line(served: Served, client: str, rate_key: str, run: int, repeats: int, summ: dict) -> str:
    f = lambda x: "-" if x is None else f"{1e3 * x:.0f}"  # noqa: E731
    others = summ["others_cpu"]
    return (
        f"[{served.system}] {CLIENT_TAGS[client]}, rate {rate_key}/s"
        + (f" run {run}/{repeats}" if repeats > 1 else "")
        + f": {summ['completed']}/{summ['requests']} ok in {summ['wall_s']:.1f}s, {summ['output_tok_s']:.0f} out "
        f"tok/s; TTFT p50/p99 {f(summ['ttft_p50'])}/{f(summ['ttft_p99'])} ms, TPOT p50/p99 {f(summ['tpot_p50'])}/"
        f"{f(summ['tpot_p99'])} ms, goodput {summ['goodput_rps']:.2f} req/s ({summ['good']}/{summ['requests']})"
        + (f", full length {summ['full_length']}/{summ['completed']}" if summ.get("full_length") is not None else "")
        + (f"; others used {100 * others:.0f}% CPU" if others is not None else "")
        + (" -- WARNING: contended" if (others or 0) > CONTENDED else "")
        + (f"; errors {summ['errors']}" if summ["errors"] else "")
    )


def measure_rates(served: Served, args, wl: dict, vllm_client: VllmClient | None, run_dir: Path, row: dict) -> dict:
    """Every run (--repeats) of every rate with each client (our client first); fills row["rates"] (our client)
    and row["vllm_rates"] (vLLM's) with the runs combined; returns our client's per-request records."""
    raw: dict = {}
    row["vllm_rates"] = {}
    for rate_key in wl["rates"]:
        runs: dict[str, list[dict]] = {c: [] for c in args.clients}
        for run, reqs in enumerate(rate_runs(wl, rate_key)[: args.repeats], 1):
            for client in args.clients:
                runs[client].append(measure_run(served, client, args, rate_key, run, reqs, vllm_client, run_dir, raw))
        combine_into(row, runs, rate_key)
    return raw


def measure_run(
    served: Served, client: str, args, rate_key: str, run: int, reqs: list[dict], vllm_client, run_dir: Path, raw: dict
) -> dict:
    """One run of one rate with one client; our client's per-request records go into `raw`."""
    if client == "ours":
        (recs, wall), others, busy = in_window(
            asyncio.run,
            run_rate(served.system, served.base, served.model, reqs, args.drain_timeout, served.headers),
        )
        summ = summarize(recs, wall, args.slo_ttft, args.slo_tpot)
        raw[rate_key if run == 1 else f"{rate_key} run{run}"] = recs
    else:
        summ, others, busy = in_window(vllm_client_run, vllm_client, args, served, float(rate_key), run, run_dir)
    rss = sum(tree_rss(s.proc.pid) for s in served.servers)
    summ.update(others_cpu=others, cpu_busy_before=busy, server_rss=rss)
    print(run_line(served, client, rate_key, run, args.repeats, summ), flush=True)
    time.sleep(1.0)
    return summ


def combine_into(row: dict, runs: dict[str, list[dict]], rate_key: str) -> None:
    for client, key in (("ours", "rates"), ("vllm", "vllm_rates")):
        if runs.get(client):
            row[key][rate_key] = combine_runs(runs[client])


def run_interleaved(
    systems: list[str], args, model_dir: Path, max_len: int, wl: dict, run_dir: Path, ports, vllm_client
) -> list[dict]:
    """--interleave: every system up at once (idle ones wait on their sockets), and each run of each rate goes to
    every system in turn, the order reversed every other run, so that a machine whose speed drifts (as shared
    cloud cores do over minutes) slows every system alike. Our servers only, no gateway extras."""
    rows, starting, served_by, raws = {}, {}, {}, {}
    try:
        for system in systems:
            row: dict = {"system": system, "label": LABELS[system], "status": "ok", "rates": {}, "vllm_rates": {}}
            rows[system] = row
            servers, model = build_servers(system, args, model_dir, max_len, run_dir, ports)
            row["commands"] = [" ".join(shlex.quote(c) for c in s.cmd) for s in servers]
            starting[system] = servers  # stopped at the end, whatever happens from here on
            served_by[system] = start_served(system, servers, model, model_dir, args, wl, row)
            raws[system] = {}
        busy = wait_idle(args.wait_idle, "all")  # once: every system is up and idle now
        for row in rows.values():
            row["cpu_busy_before_start"] = busy
        for rate_key in wl["rates"]:
            runs = {system: {c: [] for c in args.clients} for system in systems}
            for run, reqs in enumerate(rate_runs(wl, rate_key)[: args.repeats], 1):
                for system in systems if run % 2 else list(reversed(systems)):
                    for client in args.clients:
                        summ = measure_run(
                            served_by[system], client, args, rate_key, run, reqs, vllm_client, run_dir, raws[system]
                        )
                        runs[system][client].append(summ)
            for system in systems:
                combine_into(rows[system], runs[system], rate_key)
        for system, raw in raws.items():
            if raw:
                (run_dir / f"requests_{system}.json").write_text(json.dumps(raw))
    finally:
        for system, servers in starting.items():
            for s in reversed(servers):
                rows[system].setdefault("stopped", {})[s.name] = s.stop(args.stop_timeout)
    return list(rows.values())


def start_served(system: str, servers: list[Server], model: str, model_dir: Path, args, wl: dict, row: dict) -> Served:
    """Starts a system's servers, waits until each is healthy and warms them up (the row gets the times); raises
    when the warm-up fails."""
    t = time.perf_counter()
    for s in servers:
        s.start()
        row[f"ready_s_{s.name}"] = s.wait_healthy(args.start_timeout)
    row["ready_s"] = time.perf_counter() - t
    headers = auth_headers(servers[-1])
    t = time.perf_counter()
    warm = asyncio.run(run_warmup(system, servers[-1].base, model, wl["warmup"], headers))
    row["warmup_s"] = time.perf_counter() - t
    bad = [r["error"] for r in warm if not r["ok"]]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[:2]}")
    print(
        f"[{system}] ready in {row['ready_s']:.1f}s, warm-up {row['warmup_s']:.1f}s (logs: "
        f"{', '.join(str(s.log) for s in servers)})",
        flush=True,
    )
    return Served(system, servers, model, model_dir, headers)


def run_system(
    system: str,
    args,
    model_dir: Path,
    max_len: int,
    wl: dict,
    run_dir: Path,
    ports,
    vllm_client: VllmClient | None = None,
) -> dict:
    row: dict = {"system": system, "label": LABELS[system], "status": "ok", "rates": {}}
    try:
        servers, model = build_servers(system, args, model_dir, max_len, run_dir, ports)
    except Exception as e:  # noqa: BLE001
        row["status"] = f"skipped: {e}"
        print(f"[{system}] SKIPPED: {e}", flush=True)
        return row
    row["commands"] = [" ".join(shlex.quote(c) for c in s.cmd) for s in servers]
    row["cpu_busy_before_start"] = wait_idle(args.wait_idle, system)
    t_sys = time.perf_counter()
    try:
        served = start_served(system, servers, model, model_dir, args, wl, row)
        headers = served.headers
        raw = measure_rates(served, args, wl, vllm_client, run_dir, row)
        if raw:
            (run_dir / f"requests_{system}.json").write_text(json.dumps(raw))
        if system == "gateway":
            replica, gateway = servers
            if args.overhead_requests > 0:
                busy = cpu_busy(0.5)
                idle_rate = gateway_idle_cpu(gateway.proc.pid)
                probe = CpuProbe()
                probe.start()
                t, cpu = time.perf_counter(), process_cpu_s(gateway.proc.pid)
                ov = asyncio.run(gateway_overhead(replica.base, gateway.base, wl["overhead"], headers))
                wall, cpu = time.perf_counter() - t, process_cpu_s(gateway.proc.pid) - cpu
                ov["others_cpu"] = probe.stop(wall)
                ov["cpu_busy_before"] = busy
                ov["gateway_idle_cpu"] = idle_rate
                ov["gateway_cpu_ms_per_request"] = 1e3 * (cpu - idle_rate * wall) / len(wl["overhead"])
                row["overhead"] = ov
                print(
                    f"[gateway overhead] TTFT p50 direct {1e3 * ov['direct']['ttft_p50']:.2f} ms, via gateway "
                    f"{1e3 * ov['gateway']['ttft_p50']:.2f} ms: added p50 {1e3 * ov['added_ttft_p50']:.2f} ms, "
                    f"p99 {1e3 * ov['added_ttft_p99']:.2f} ms; gateway CPU per request "
                    f"{ov['gateway_cpu_ms_per_request']:.2f} ms; others used {100 * (ov['others_cpu'] or 0):.0f}% CPU",
                    flush=True,
                )
            if args.idle_streams:
                gateway.stop(args.stop_timeout)  # the idle-stream runs each use a fresh gateway process
                row["idle_streams"] = idle_streams_phase(args, model_dir, replica, wl["idle_prompt"], run_dir, ports)
    except Exception as e:  # noqa: BLE001
        row["status"] = f"failed: {e.__class__.__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}"
        print(f"[{system}] FAILED: {e}", flush=True)
    finally:
        for s in reversed(servers):
            row.setdefault("stopped", {})[s.name] = s.stop(args.stop_timeout)
    row["total_s"] = time.perf_counter() - t_sys
    return row


# ----------------------------------------------------------------------------------------------------------------- #
# report
# ----------------------------------------------------------------------------------------------------------------- #


def versions(args) -> dict:
    v = package_versions(("tokenfleet", "torch", "transformers", "httpx", "httptools", "uvicorn", "fastapi"))
    if Path(args.vllm_python).exists():
        try:
            r = subprocess.run(
                [
                    args.vllm_python,
                    "-c",
                    "from importlib.metadata import version as v; print(v('vllm-cpu'), v('torch'))",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            vv, vt = r.stdout.split()
            v["vllm-cpu"], v["torch (vLLM venv)"] = vv, vt
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    return v


def _ms(x, digits: int = 0) -> str:
    return "—" if x is None else f"{1e3 * x:.{digits}f}"


def kept_rows(path: Path, run_now: list[str]) -> list[dict]:
    """The rows of an earlier report (its JSON) for the systems not run now, each with where it came from (a row
    that report had itself kept keeps its own origin)."""
    old = json.loads(path.read_text())
    rows = [r for r in old["systems"] if r["system"] not in run_now]
    w = old["workload"]
    shown = os.path.relpath(path.resolve(), REPO) if path.resolve().is_relative_to(REPO) else str(path)
    origin = {
        "path": shown,
        "date": old["date"],
        "command": old["command"],
        "tokenfleet": old["versions"].get("tokenfleet"),
        "workload": f"{w['num_requests']} requests per rate at {', '.join(f'{x:g}' for x in w['rates'])} req/s",
        "notes": [
            n for n in old.get("notes", []) if _mentions(n, [r["system"] for r in rows]) and not _mentions(n, run_now)
        ],
    }
    return [dict(r, kept_from=r.get("kept_from") or origin) for r in rows]


def _mentions(note: str, systems: list[str]) -> bool:
    words = {"serve": "tokenfleet serve", "gateway": "gateway", "vllm": "vLLM", "transformers": "transformers"}
    return any(words[s] in note for s in systems)


def _kept_lines(rows: list[dict]) -> list[str]:
    origins: dict[str, tuple[dict, list[str]]] = {}
    for r in rows:
        origins.setdefault(r["kept_from"]["date"] + r["kept_from"]["command"], (r["kept_from"], []))[1].append(
            r["label"]
        )
    L = ["", "## Rows kept from an earlier run"]
    for o, labels in origins.values():
        L += [
            "",
            f'The rows marked "(earlier run)" of {", ".join(labels)} were not measured in this run: they are '
            f"copied from `{o['path']}` ({o['date']}, tokenfleet {o['tokenfleet']}; {o['workload']}; command "
            f"`{o['command']}`). Compare them with this run's rows with that in mind.",
        ]
        if o["notes"]:
            L += ["", "That run's notes on them:", ""] + [f"- {n}" for n in o["notes"]]
    return L


def _n(x) -> str:
    """A count (a median of counts may be a half)."""
    return "—" if x is None else (f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}")


def _others(r: dict) -> str:
    oc = r.get("others_cpu")
    return "?" if oc is None else f"{100 * oc:.0f}%" + (" ⚠" if oc > CONTENDED else "")


def _spread(r: dict, key: str, show) -> str:
    """The min–max of a metric over the runs of a rate, in brackets; nothing for a single run."""
    lo_hi = (r.get("spread") or {}).get(key)
    return f" [{show(lo_hi[0])}–{show(lo_hi[1])}]" if r.get("runs", 1) > 1 and lo_hi else ""


def _goodput(r: dict) -> str:
    return f"{r['goodput_rps']:.2f}" + _spread(r, "goodput_rps", lambda x: f"{x:.2f}")


def _ttft_p99(r: dict) -> str:
    return _ms(r["ttft_p99"]) + _spread(r, "ttft_p99", _ms)


def _runs_text(w: dict) -> str:
    k = w.get("repeats", 1)
    if k <= 1:
        return "One run per system and rate."
    return (
        f"{k} runs per system and rate, each with its own seeded workload (no run finds another's prompts in a "
        "prefix cache): each cell is the MEDIAN over the runs, with the min–max of goodput and TTFT p99 in "
        "[brackets]; others' CPU and client lag: the worst run; errors: summed."
    )


def _vllm_client_text(w: dict) -> list[str]:
    v = w.get("vllm_client")
    if not v:
        return []
    return [
        f"vLLM's benchmark client (vllm-cpu {v['vllm']}'s `vllm bench serve` code, aiohttp, in a subprocess of its "
        f"venv): `--backend openai-chat --dataset-name random --random-input-len {v['random_input_len']} "
        f"--random-output-len {v['random_output_len']} --random-range-ratio {v['random_range_ratio']} --num-prompts "
        f"{w['num_requests']} --request-rate RATE --ignore-eos --temperature 0` — Poisson arrivals, prompts of "
        f"random token ids, {v['input_range'][0]}–{v['input_range'][1]} tokens before the chat template (its "
        f"tokenizer adds {v['num_special_tokens']} special token(s), which it subtracts from --random-input-len), "
        f"outputs {v['output_range'][0]}–{v['output_range'][1]} tokens; its own seed per rate and run, the same for "
        "every system. Its TTFT is the first chunk with a choice (vLLM's server sends a role-only chunk with the "
        "first token; tokenfleet's first chunk carries both); its numbers are the ones in its result JSON; "
        "its requests have no drain deadline.",
        "",
    ]


def _side_by_side_lines(rep: dict) -> list[str]:
    """Issue 22's table: per tokenfleet system and client, each rate's numbers next to vLLM's."""
    peer = next((s for s in rep["systems"] if s["system"] == "vllm" and not s.get("kept_from")), None)
    if peer is None:
        return []
    L = []
    for tf in (s for s in rep["systems"] if s["system"] in ("serve", "gateway") and not s.get("kept_from")):
        for key, client in (("vllm_rates", "vLLM's benchmark client"), ("rates", "our client")):
            ours, theirs = tf.get(key) or {}, peer.get(key) or {}
            rates = [k for k in ours if k in theirs]
            if not rates:
                continue
            L += [
                "",
                f"### {tf['label']} / {peer['label']} — {client}",
                "",
                "| rate req/s | goodput tokenfleet / vLLM | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ok | others | "
                "goodput ≥ vLLM's |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for k in rates:
                a, b = ours[k], theirs[k]
                at_least = "yes" if a["goodput_rps"] >= b["goodput_rps"] else "**no**"
                L.append(
                    f"| {k} | {_goodput(a)} / {_goodput(b)} | {_ms(a['ttft_p50'])} / {_ms(b['ttft_p50'])} | "
                    f"{_ttft_p99(a)} / {_ttft_p99(b)} | {_ms(a['tpot_p50'], 1)} / {_ms(b['tpot_p50'], 1)} | "
                    f"{_n(a['completed'])} / {_n(b['completed'])} | {_others(a)} / {_others(b)} | {at_least} |"
                )
    if not L:
        return []
    return [
        "## TTFT vs rate, side by side",
        "",
        "Each cell: tokenfleet / vLLM, the same client and workload. Target (issue 22): goodput ≥ vLLM-CPU's at "
        "every rate, TTFT p99 ≤ vLLM's at 32 req/s. " + _runs_text(rep["workload"]),
        *L,
        "",
    ]


def _our_client_lines(rep: dict) -> list[str]:
    if not any(s.get("rates") or s["status"] != "ok" for s in rep["systems"]):
        return []
    L = [
        "## Summary — our client",
        "",
        "| system | rate req/s | ok | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | goodput req/s (met SLO) | "
        "output tok/s | others | client lag max ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in rep["systems"]:
        if s["status"] != "ok" and not s.get("rates"):
            L.append(f"| {s['label']} | — | — | — | — | — | — | — | — | — | {s['status']} |")
            continue
        for rate, r in s["rates"].items():
            lag = r["max_client_lag_s"]
            L.append(
                f"| {s['label']} | {rate} | {_n(r['completed'])}/{_n(r['requests'])} | {_ms(r['ttft_p50'])} | "
                f"{_ttft_p99(r)} | {_ms(r['tpot_p50'], 1)} | {_ms(r['tpot_p99'], 1)} | "
                f"{_goodput(r)} ({_n(r['good'])}/{_n(r['requests'])}) | {r['output_tok_s']:.0f} | {_others(r)} | "
                f"{_ms(lag)}{' ⚠' if (lag or 0) > CLIENT_LAG else ''} |"
            )
    L += [
        "",
        "## Details — our client",
        "",
        "| system | rate | ITL p50 | ITL p99 | E2E p50 | E2E p99 | req/s | full-length outputs | content chunks / "
        "token | mean prompt tokens | server RSS MiB | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in rep["systems"]:
        for rate, r in s.get("rates", {}).items():
            cpt = "—" if r["chunks_per_token"] is None else f"{r['chunks_per_token']:.2f}"
            mpt = "—" if r["mean_prompt_tokens"] is None else f"{r['mean_prompt_tokens']:.0f}"
            err = "; ".join(f"{k} ×{v}" for k, v in r["errors"].items()) or ""
            L.append(
                f"| {s['label']} | {rate} | {_ms(r['itl_p50'], 1)} | {_ms(r['itl_p99'], 1)} | "
                f"{_ms(r['e2e_p50'])} | {_ms(r['e2e_p99'])} | {r['req_s']:.2f} | {_n(r['full_length'])}/"
                f"{_n(r['completed'])} | {cpt} | {mpt} | {r['server_rss'] / 2**20:.0f} | {err[:200]} |"
            )
    return L


def _vllm_client_lines(rep: dict) -> list[str]:
    rows = [(s, rate, r) for s in rep["systems"] for rate, r in (s.get("vllm_rates") or {}).items()]
    if not rows:
        return []
    L = [
        "",
        "## Summary — vLLM's benchmark client",
        "",
        "| system | rate req/s | ok | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 | E2E p50 | "
        "goodput req/s (met SLO) | output tok/s | full-length outputs | mean prompt tokens | others | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s, rate, r in rows:
        mpt = "—" if r["mean_prompt_tokens"] is None else f"{r['mean_prompt_tokens']:.0f}"
        err = "; ".join(f"{k} ×{v}" for k, v in r["errors"].items()) or ""
        L.append(
            f"| {s['label']} | {rate} | {_n(r['completed'])}/{_n(r['requests'])} | {_ms(r['ttft_p50'])} | "
            f"{_ttft_p99(r)} | {_ms(r['tpot_p50'], 1)} | {_ms(r['tpot_p99'], 1)} | {_ms(r['itl_p50'], 1)} | "
            f"{_ms(r['itl_p99'], 1)} | {_ms(r['e2e_p50'])} | {_goodput(r)} ({_n(r['good'])}/{_n(r['requests'])}) | "
            f"{r['output_tok_s']:.0f} | {_n(r['full_length'])}/{_n(r['completed'])} | {mpt} | {_others(r)} | "
            f"{err[:200]} |"
        )
    return L


def write_report(path: Path, rep: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(rep, indent=1))
    kept = [r for r in rep["systems"] if r.get("kept_from")]
    rep = {
        **rep,
        "systems": [dict(r, label=r["label"] + " (earlier run)") if r.get("kept_from") else r for r in rep["systems"]],
    }
    m, w, c = rep["machine"], rep["workload"], rep["checkpoint"]
    slo = rep["slo"]
    L = [
        f"# Served load — {rep['date']}",
        "",
        f"Command: `{rep['command']}`",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['memory']} RAM; Python {m['python']}; versions: "
        + ", ".join(f"{k} {v}" for k, v in rep["versions"].items() if v),
        "",
        f"Checkpoint: `{c['dir']}` — {c['source']}; {c['info'].get('parameters', 0) / 1e6:.1f}M parameters "
        f"(hidden {c['info'].get('hidden_size')}, layers {c['info'].get('num_hidden_layers')}, heads "
        f"{c['info'].get('num_attention_heads')}/{c['info'].get('num_key_value_heads')} kv, vocab "
        f"{c['info'].get('vocab_size')}), float32, random weights. KV cache {w['kv_cache_gib']:g} GiB for tokenfleet "
        "and vLLM; transformers sizes its own.",
        "",
        f"Workload of our client (same for every system): per rate, {w['num_requests']} requests with Poisson "
        f"arrivals (seed {w['seed']}); prompts = random words from a fixed list, {w['prompt_min']}–{w['prompt_max']} "
        f"tokens before the chat template; max_tokens uniform {w['output_min']}–{w['output_max']}; streaming chat "
        "completions, temperature 0, ignore_eos (transformers: `generation_config` eos_token_id=-1, see notes). Our "
        "client: one asyncio httpx client in the harness process; a rate's window ends at last arrival + "
        f"{w['drain_timeout']:g} s. " + _runs_text(w),
        "",
        *_vllm_client_text(w),
        f"**SLO: TTFT <= {slo['ttft_s']:g} s and TPOT <= {1e3 * slo['tpot_s']:g} ms.** Goodput = requests/s that "
        "completed within the SLO (window = first send to last end). TTFT = first non-empty content chunk; ITL = gap "
        'between content chunks; TPOT = (E2E − TTFT)/(output tokens − 1). Times in ms. "Others" = CPU used by '
        f"processes outside the benchmark during the window, share of all cores (>{100 * CONTENDED:.0f}%: "
        'contended, timing unreliable). "Client lag" = how late the client sent a request vs. its scheduled arrival '
        f"(>{1e3 * CLIENT_LAG:.0f} ms ⚠: the client process itself was starved of CPU, so its timestamps -- TTFT, "
        "ITL tails -- include that stall).",
        "",
    ]
    L += _side_by_side_lines(rep) + _our_client_lines(rep) + _vllm_client_lines(rep)
    gw = next((s for s in rep["systems"] if s["system"] == "gateway"), None)
    if gw and gw.get("overhead"):
        ov = gw["overhead"]
        d, g = ov["direct"], ov["gateway"]
        verdict = (
            "—"
            if ov["added_ttft_p50"] is None
            else ("meets the <= 2 ms target" if ov["added_ttft_p50"] <= 0.002 else "MISSES the <= 2 ms target")
        )
        oc = "?" if ov.get("others_cpu") is None else f"{100 * ov['others_cpu']:.0f}%"
        L += [
            "",
            "## Latency the gateway adds (tokenfleet)",
            "",
            f"{ov['pairs']} sequential requests (after 4 warm-up pairs), each sent once straight to the replica and "
            "once through `tokenfleet gateway` in front of it (separate process, HTTP to the replica), alternating "
            "which goes first; prompts 32–96 tokens (different words for the two, same length), 8 output tokens. "
            f"Other CPU load meanwhile: {oc}.",
            "",
            "| path | ok | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | E2E p50 ms |",
            "|---|---:|---:|---:|---:|---:|",
            f"| replica directly | {d['completed']} | {_ms(d['ttft_p50'], 2)} | {_ms(d['ttft_p99'], 2)} | "
            f"{_ms(d['itl_p50'], 2)} | {_ms(d['e2e_p50'], 2)} |",
            f"| through the gateway | {g['completed']} | {_ms(g['ttft_p50'], 2)} | {_ms(g['ttft_p99'], 2)} | "
            f"{_ms(g['itl_p50'], 2)} | {_ms(g['e2e_p50'], 2)} |",
            f"| **added by the gateway** | | **{_ms(ov['added_ttft_p50'], 2)}** | {_ms(ov['added_ttft_p99'], 2)} | "
            f"{_ms(ov['added_itl_p50'], 2)} | {_ms(ov['added_e2e_p50'], 2)} |",
            "",
            f"Added TTFT, p50: {_ms(ov['added_ttft_p50'], 2)} ms ({verdict}); median of the per-pair differences: "
            f"{_ms(ov['added_ttft_paired_median'], 2)} ms.",
        ]
        if ov.get("gateway_cpu_ms_per_request") is not None:
            L += [
                "",
                f"Gateway CPU per request (8 streamed tokens, warm-up included; the gateway process's /proc CPU "
                f"time over the phase, net of its idle use of {100 * ov['gateway_idle_cpu']:.1f}% of a core): "
                f"**{ov['gateway_cpu_ms_per_request']:.2f} ms**.",
            ]
    if gw and gw.get("idle_streams"):
        L += [
            "",
            "## Concurrent idle streams in one gateway process (tokenfleet)",
            "",
            "Per N: a fresh `tokenfleet gateway` process in front of the replica, warmed up (3 requests), RSS read; "
            "then the replica is paused (SIGSTOP) and N streaming chat requests are opened through the gateway and "
            "held: each is admitted (HTTP 200, SSE headers sent) and its relay waits for a replica that sends "
            "nothing — a stream queued behind an engine that cannot take it, with no tokens flowing, so the RSS "
            "growth is the gateway's own per-stream state. RSS = VmRSS of the gateway process.",
            "",
            "| N requested | held open | failed | open time s | gateway RSS before MiB | RSS with N open MiB | "
            "**bytes / stream** | gateway→replica connections | RSS after clients left MiB | tracebacks in gateway log |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in gw["idle_streams"]:
            if r.get("error") and r.get("rss_open") is None:
                L.append(f"| {r['n']} | — | — | — | — | — | — | — | failed: {r['error'][:150]} |")
                continue
            bps = "—" if r.get("bytes_per_stream") is None else f"{r['bytes_per_stream'] / 1024:.1f} KiB"
            fail = sum(r["failed"].values())
            L.append(
                f"| {r['n']} | {r['opened']} | {fail}{' ' + str(r['failed']) if fail else ''} | "
                f"{r['open_s']:.1f} | {r['rss_before'] / 2**20:.1f} | {r['rss_open'] / 2**20:.1f} | **{bps}** | "
                f"{r['upstream_connections']} | {r['rss_after_close'] / 2**20:.1f} | {r.get('log_tracebacks', '?')} |"
            )
        errs = sorted({r["log_last_error"] for r in gw["idle_streams"] if r.get("log_last_error")})
        if errs:
            L += [
                "",
                "Errors in the gateway's log (after the clients disconnected): " + "; ".join(f"`{e}`" for e in errs),
            ]
        L += [
            "",
            f'"RSS after clients left" is read {rep["idle_after_wait"]:g} s after the clients disconnected '
            "(before the replica is resumed).",
        ]
    L += ["", "## Systems", ""]
    for s in rep["systems"]:
        cmds = "; ".join(f"`{c}`" for c in s.get("commands", []))
        extra = ""
        if s.get("ready_s") is not None:
            extra = f" Ready (healthy) after {s['ready_s']:.1f} s, warm-up {s.get('warmup_s', 0):.1f} s."
        L.append(f"- **{s['label']}** — status: {s['status']}. {cmds}.{extra}")
    if kept:
        L += _kept_lines(kept)
    if rep.get("notes"):
        L += ["", "## Notes", ""] + [f"- {n}" for n in rep["notes"]]
        if rep.get("json_rerenders"):
            L += ["", "(Notes beyond the automatic ones were added after the run with `--rerender ... --note ...`.)"]
    L += [
        "",
        "Methodology: see the docstring of `bench/served_load.py`; raw per-request records, server logs and the "
        f"workload are in the run directory (`{rep['run_dir']}`).",
        "",
    ]
    path.write_text("\n".join(L))
    print(f"wrote {path} and {path.with_suffix('.json')}")


# ----------------------------------------------------------------------------------------------------------------- #
# main
# ----------------------------------------------------------------------------------------------------------------- #


def main(argv=None) -> None:
    p = bench_parser(__doc__)
    p.epilog = __doc__.split("\n\n", 1)[1]  # the methodology: systems, clients, --repeats, --preset, the report
    add_checkpoint_args(p, "served-checkpoints")
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"comma separated, from {ALL_SYSTEMS}")
    p.add_argument("--rates", default="1,2,4,8", help="request rates (req/s), comma separated")
    p.add_argument("--num-requests", type=int, default=40, help="requests per rate")
    add_length_args(p)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="SLO on TTFT, seconds (default 2)")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="SLO on TPOT, seconds (default 0.1)")
    p.add_argument(
        "--idle-streams",
        default="200,500,1000",
        help="concurrent idle streams to hold in one gateway process ('' = skip)",
    )
    p.add_argument("--idle-open-timeout", type=float, default=60.0)
    p.add_argument("--idle-after-wait", type=float, default=8.0)
    p.add_argument("--overhead-requests", type=int, default=40, help="gateway-overhead pairs (0 = skip)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=90.0,
        help="a rate's window ends this long after its last arrival; unfinished requests fail",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV cache of tokenfleet and vLLM")
    p.add_argument("--tokenfleet-args", default="", help="extra flags for `tokenfleet serve` / `tokenfleet replica`")
    p.add_argument(
        "--vllm-python",
        default="/tmp/vllm/bin/python",
        help="the vLLM venv's python: runs vLLM's server and vLLM's benchmark client",
    )
    p.add_argument("--vllm-args", default="", help="extra flags for vLLM's server")
    p.add_argument("--transformers-args", default="", help="extra flags for `transformers serve`")
    p.add_argument("--base-port", type=int, default=18400, help="first loopback port to try")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--stop-timeout", type=float, default=20.0, help="SIGTERM, then SIGKILL after this many seconds")
    p.add_argument(
        "--wait-idle",
        type=int,
        default=300,
        help="before each system, wait up to this many seconds for other work on the machine to stop",
    )
    p.add_argument("--out", default="docs/benchmarks/served_load.md", help="'' = no report files")
    p.add_argument("--run-dir", help="where workload, logs and raw results go (default: a new temp dir)")
    p.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    p.add_argument(
        "--keep-systems-from",
        metavar="JSON",
        help="an earlier report's JSON: copy the rows of the systems not run now from it (marked)",
    )
    p.add_argument(
        "--rerender",
        metavar="JSON",
        help="do not run anything: rewrite the markdown from a previous run's JSON (plus any --note lines)",
    )
    p.add_argument(
        "--client",
        choices=["ours", "vllm", "both"],
        default="ours",
        help="load generator: ours (httpx, in this process), vllm (vLLM's `vllm bench serve` client, from "
        "--vllm-python's venv) or both (each run of a rate with ours, then with vLLM's)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each (system, rate), each with its own seeded workload; the report shows each metric's median "
        "over them and the min-max of goodput and TTFT p99",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="all systems up at once; each run of each rate goes to every system in turn (the order reversed every "
        "other run), so that a machine whose speed drifts slows all alike (serve and vllm only, no gateway extras)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a named set of defaults; flags given explicitly override it. saturation (issue 22): "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in PRESETS["saturation"].items()),
    )
    args = p.parse_args(argv)
    if args.preset:
        p.set_defaults(**PRESETS[args.preset])
        args = p.parse_args(argv)

    if args.rerender:
        rep, md = report_to_rerender(args)
        rep["json_rerenders"] = rep.get("json_rerenders", 0) + 1
        write_report(md, rep)
        return

    systems = known_names(p, args.systems, ALL_SYSTEMS, "systems")
    args.clients = ["ours", "vllm"] if args.client == "both" else [args.client]
    if args.repeats < 1:
        p.error("--repeats: at least 1")
    if "vllm" in args.clients and not Path(args.vllm_python).exists():
        p.error(f"--client {args.client}: vLLM python {args.vllm_python} not found (run bench/setup_peers.sh)")
    kept = kept_rows(Path(args.keep_systems_from), systems) if args.keep_systems_from else []
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates):
        p.error("--rates: positive numbers")
    args.idle_streams = [int(x) for x in args.idle_streams.split(",") if x.strip()]
    command = command_line(__file__)

    model_dir, source = ensure_checkpoint(args)
    info = checkpoint_info(model_dir)
    window = info.get("max_position_embeddings") or 4096
    max_len = min(4096, window)
    if args.prompt_max + args.output_max + 64 > max_len:
        p.error(f"prompt-max + output-max (+ chat template) exceed the model's window {max_len}")
    print(f"checkpoint: {model_dir} ({source}; {info['parameters'] / 1e6:.1f}M params)")
    run_dir = make_run_dir(args.run_dir, "tokenfleet-served-")
    wl = make_workload(args, model_dir, rates, args.repeats)
    (run_dir / "workload.json").write_text(json.dumps(wl))
    print(
        f"workload: {len(rates)} rates x {args.num_requests} requests x {args.repeats} runs -> "
        f"{run_dir / 'workload.json'}"
    )

    vllm_client, vllm_workload = None, None
    if "vllm" in args.clients:
        vllm_client = VllmClient(args.vllm_python, model_dir, run_dir / "vllm_client.log")
        ready = vllm_client.start()  # before the machine is checked idle: it idles between its runs
        vllm_workload = dict(vllm_workload_args(args, ready["num_special_tokens"]), **ready)
        print(f"vLLM's client ready (vllm-cpu {ready['vllm']}): {vllm_workload}", flush=True)
    ports = PortAllocator(args.base_port)
    t_all = time.perf_counter()
    rows = []
    try:
        if args.interleave:
            rows = run_interleaved(systems, args, model_dir, max_len, wl, run_dir, ports, vllm_client)
        else:
            for s in systems:
                rows.append(run_system(s, args, model_dir, max_len, wl, run_dir, ports, vllm_client))
    finally:
        if vllm_client is not None:
            vllm_client.close()
    total = time.perf_counter() - t_all
    print(f"\nall systems done in {total:.0f}s; run dir (workload, logs, raw records): {run_dir}")
    order = {name: i for i, name in enumerate(ALL_SYSTEMS)}
    report_rows = sorted(rows + kept, key=lambda r: order[r["system"]])

    notes = list(args.note)
    contended = [
        (r["label"] + tag, k, x["others_cpu"])
        for r in rows
        for key, tag in (("rates", ""), ("vllm_rates", " (vLLM's client)"))
        for k, x in r.get(key, {}).items()
        if (x.get("others_cpu") or 0) > CONTENDED
    ]
    if contended:
        notes.append(
            "Other processes competed for the CPUs during: "
            + "; ".join(f"{lab} at {k} req/s ({100 * oc:.0f}% of the cores)" for lab, k, oc in contended)
            + " — those rows are unreliable."
        )
    lagged = [
        (r["label"], k, x["max_client_lag_s"])
        for r in rows
        for k, x in r.get("rates", {}).items()
        if (x.get("max_client_lag_s") or 0) > CLIENT_LAG
    ]
    if lagged:
        notes.append(
            "The client was starved of CPU (requests sent late) during: "
            + "; ".join(f"{lab} at {k} req/s (up to {1e3 * lag:.0f} ms)" for lab, k, lag in lagged)
            + " — tail latencies there include client-side stalls."
        )
    if args.out:
        rep = {
            "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "command": command,
            "machine": machine_info(args),
            "versions": versions(args),
            "checkpoint": {"dir": str(model_dir), "source": source, "info": info},
            "workload": {
                "num_requests": args.num_requests,
                "rates": rates,
                "seed": args.seed,
                "prompt_min": args.prompt_min,
                "prompt_max": args.prompt_max,
                "output_min": args.output_min,
                "output_max": args.output_max,
                "drain_timeout": args.drain_timeout,
                "kv_cache_gib": args.kv_cache_gib,
                "clients": args.clients,
                "repeats": args.repeats,
                "preset": args.preset,
                "vllm_client": vllm_workload,
            },
            "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
            "idle_after_wait": args.idle_after_wait,
            "systems": report_rows,
            "notes": notes,
            "run_dir": str(run_dir),
            "total_s": total,
        }
        write_report((REPO / args.out) if not os.path.isabs(args.out) else Path(args.out), rep)


if __name__ == "__main__":
    main()
