#!/usr/bin/env python3
"""Where the time to first token of a burst goes inside `tokenfleet serve` (issue 22): the replica's histograms
(vLLM's names: time_to_first_token, request_queue_time, request_prefill_time) and the engine's step phases, read from
/metrics before and after one run of vLLM's own benchmark client at a given rate.

    python bench/ttft_phases.py --rate 32    # needs the vLLM venv (--vllm-python) and the served_load checkpoint
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

import httpx

HISTOGRAMS = ("time_to_first_token", "request_queue_time", "request_prefill_time", "e2e_request_latency")
CLIENT = (
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; from vllm.benchmarks.serve import add_cli_args, "
    "main; import sys; p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def scrape(base: str) -> dict[tuple[str, str], float]:
    """Histogram samples by (name, le) and the engine's step seconds by phase."""
    values: dict[tuple[str, str], float] = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        sample = re.match(r"^(vllm:\w+_seconds_(?:sum|count|bucket))\{([^}]*)\} (\S+)", line)
        if sample:
            le = re.search(r'le="([^"]+)"', sample.group(2))
            values[(sample.group(1), le.group(1) if le else "")] = float(sample.group(3))
        phase = re.match(r'^tokenfleet:engine_step_seconds_total\{.*phase="(\w+)".*\} (\S+)', line)
        if phase:
            values[("phase", phase.group(1))] = float(phase.group(2))
    return values


def report(delta: dict[tuple[str, str], float]) -> None:
    for name in HISTOGRAMS:
        total, count = (
            delta.get((f"vllm:{name}_seconds_sum", ""), 0.0),
            delta.get((f"vllm:{name}_seconds_count", ""), 0.0),
        )
        buckets = sorted(
            (float(le), n) for (k, le), n in delta.items() if k == f"vllm:{name}_seconds_bucket" and le != "+Inf"
        )
        p99 = next((le for le, n in buckets if n >= 0.99 * count), None) if count else None
        print(f"{name}: mean {1000 * total / max(count, 1):.1f} ms over {count:.0f} requests, p99 <= {p99} s")
    phases = {k[1]: round(v, 3) for k, v in delta.items() if k[0] == "phase"}
    print(f"engine step seconds by phase: {phases}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=32.0)
    p.add_argument("--model", default="/tmp/tokenfleet-bench/served-checkpoints/demo-small")
    p.add_argument("--vllm-python", default="/tmp/vllm/bin/python")
    p.add_argument("--port", type=int, default=18555)
    args = p.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    serve = [sys.executable, "-m", "tokenfleet", "serve", "--model", args.model, "--host", "127.0.0.1"]
    serve += ["--port", str(args.port), "--served-model-name", "bench", "--kv-cache-gib", "2"]
    server = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = [args.vllm_python, "-c", CLIENT, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions"]
        client += ["--base-url", base, "--model", "bench", "--tokenizer", args.model, "--dataset-name", "random"]
        client += ["--random-input-len", "257", "--random-output-len", "64", "--random-range-ratio", "0.5"]
        client += [
            "--ignore-eos",
            "--temperature",
            "0",
            "--percentile-metrics",
            "ttft,tpot",
            "--metric-percentiles",
            "50,99",
        ]
        subprocess.run(
            [*client, "--num-prompts", "20", "--request-rate", "8", "--seed", "7"], capture_output=True
        )  # warm-up
        before = scrape(base)
        run = [*client, "--num-prompts", "120", "--request-rate", f"{args.rate:g}", "--seed", "1"]
        result = subprocess.run(run, capture_output=True, text=True)
        after = scrape(base)
        print("\n".join(line for line in result.stdout.splitlines() if "TTFT" in line or "TPOT" in line))
        report({k: after.get(k, 0.0) - before.get(k, 0.0) for k in after})
    finally:
        server.terminate()
        server.wait(20)


if __name__ == "__main__":
    main()
