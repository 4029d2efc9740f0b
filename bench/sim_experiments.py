#!/usr/bin/env python3
"""Issue 7 part 4 experiments with the fleet simulator (same seed, same numbers).

    python bench/sim_experiments.py capacity   # docs/benchmarks/sim_capacity.md: nodes for 7,000 req/s at peak
    python bench/sim_experiments.py routing    # docs/benchmarks/sim_routing.md: the three routing policies
    python bench/sim_experiments.py overload   # docs/benchmarks/sim_overload.md: the ladder in a launch-day spike
    python bench/sim_experiments.py autoscale  # docs/benchmarks/sim_autoscale.md: forecast vs reactive over a day
    python bench/sim_experiments.py disagg     # docs/benchmarks/sim_disagg.md: chunked prefill vs P/D pools

capacity: bench/sim/capacity.yaml (16 nodes of the 70B in FP8 on 8 H100s) at several arrival rates per node; the
highest rate at which every interactive tier (enterprise, paid, free) keeps TTFT p99 <= --ttft-p99 and inter-token
latency p99 <= --itl-p99 is what one node sustains; nodes for the design's 7,000 req/s peak = 7,000 / that rate.
routing: the same fleet at --rate per node under each routing policy: prefix hit rate, TTFT, ITL, throughput.
overload: bench/sim/overload.yaml, a launch-day spike (4x in half a minute) with the overload ladder and without it:
who is paused, capped, shed or delayed, TTFT per tier over time.
autoscale: bench/sim/autoscale.yaml, a compressed day under the real autoscaler in forecast and reactive mode, and a
static fleet sized for the peak: GPU-hours and SLO misses.
disagg: bench/sim/disagg.yaml, chunked prefill on every replica against separate prefill and decode pools at equal
GPU count: goodput under strict TTFT and ITL targets.
plots: redraws the PNGs from the JSON results in docs/benchmarks/ without running anything.
Every experiment writes docs/benchmarks/sim_EXPERIMENT.{md,json,png}. capacity and routing run their simulations
--jobs at a time (default: one per core), each in its own process; each is seeded, so the numbers are the same.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenfleet.sim import config  # noqa: E402
from tokenfleet.sim.fleet import Fleet  # noqa: E402
from tokenfleet.sim.report import build_report  # noqa: E402

INTERACTIVE = ("enterprise", "paid", "free")
PEAK_RPS = 7000


def run(raw: dict) -> dict:
    started = time.process_time()
    fleet = Fleet(config.parse(raw)).run()
    report = build_report(fleet, time.process_time() - started)
    tiers = [report["tiers"][t] for t in INTERACTIVE if t in report["tiers"]]
    report["worst"] = {
        "ttft_p99_ms": max(t["ttft_ms"]["p99"] for t in tiers),
        "itl_p99_ms": max(t["itl_ms"]["p99"] for t in tiers),
    }
    return report


def run_all(raws: list[dict], jobs: int) -> list[dict]:
    """run() of each config, `jobs` processes at a time, in order."""
    if jobs <= 1 or len(raws) <= 1:
        return [run(raw) for raw in raws]
    with ProcessPoolExecutor(min(jobs, len(raws))) as pool:
        return list(pool.map(run, raws))


def capacity(base: dict, args) -> dict:
    rows, raws, rates = [], [], [float(x) for x in args.rates.split(",")]
    for per_node in rates:
        raw = copy.deepcopy(base)
        raw["workload"]["rate"] = per_node * raw["fleet"]["replicas"]
        raws.append(raw)
    for per_node, raw, r in zip(rates, raws, run_all(raws, args.jobs)):
        ok = r["worst"]["ttft_p99_ms"] <= args.ttft_p99 * 1000 and r["worst"]["itl_p99_ms"] <= args.itl_p99 * 1000
        rows.append(
            {
                "per_node_rps": per_node,
                "meets_slo": ok,
                **r["worst"],
                "output_tok_s_per_node": r["totals"]["output_tokens_per_s"] / raw["fleet"]["replicas"],
                "busy": r["totals"]["replica_busy_share"],
                "preemptions": r["totals"]["preemptions"],
                "prefix_hit_rate": r["totals"]["prefix_hit_rate"],
            }
        )
        print(rows[-1], file=sys.stderr)
    best = max((row for row in rows if row["meets_slo"]), key=lambda row: row["per_node_rps"], default=None)
    nodes = math.ceil(PEAK_RPS / best["per_node_rps"]) if best else None
    return {"rows": rows, "best": best, "nodes_for_peak": nodes, "gpus_for_peak": nodes and nodes * 8}


def routing(base: dict, args) -> dict:
    rows, raws, policies = [], [], ("round_robin", "least_loaded", "cache_aware")
    for policy in policies:
        raw = copy.deepcopy(base)
        raw["workload"]["rate"] = args.rate * raw["fleet"]["replicas"]
        raw["routing"] = {"policy": policy}
        raws.append(raw)
    for policy, r in zip(policies, run_all(raws, args.jobs)):
        paid = r["tiers"]["paid"]
        rows.append(
            {
                "policy": policy,
                "prefix_hit_rate": r["totals"]["prefix_hit_rate"],
                "ttft_p50_ms": paid["ttft_ms"]["p50"],
                "ttft_p99_ms": r["worst"]["ttft_p99_ms"],
                "itl_p99_ms": r["worst"]["itl_p99_ms"],
                "output_tok_s": r["totals"]["output_tokens_per_s"],
                "busy": r["totals"]["replica_busy_share"],
                "preemptions": r["totals"]["preemptions"],
            }
        )
        print(rows[-1], file=sys.stderr)
    return {"rows": rows}


def render_capacity(result: dict, args, head: list[str]) -> str:
    lines = head + [
        f"SLO for every interactive tier: TTFT p99 <= {args.ttft_p99:g} s, inter-token latency p99 <= "
        f"{args.itl_p99:g} s.",
        "",
        "| req/s per node | meets SLO | worst TTFT p99 (ms) | worst ITL p99 (ms) | output tok/s per node | "
        "busy | preemptions | prefix hit rate |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['per_node_rps']:g} | {'yes' if r['meets_slo'] else 'no'} | {r['ttft_p99_ms']:.0f} | "
            f"{r['itl_p99_ms']:.1f} | {r['output_tok_s_per_node']:.0f} | {r['busy']:.0%} | "
            f"{r['preemptions']} | {r['prefix_hit_rate']:.1%} |"
        )
    best = result["best"]
    if best:
        lines += [
            "",
            f"One node sustains **{best['per_node_rps']:g} req/s** ({best['output_tok_s_per_node']:.0f} "
            f"output tokens/s) within the SLO, so the design's peak of {PEAK_RPS:,} req/s needs "
            f"**{result['nodes_for_peak']} nodes ({result['gpus_for_peak']:,} GPUs)**, against the design's "
            "estimate of about 190 nodes (from an assumed 15,000 output tokens/s per node).",
        ]
    return "\n".join(lines) + "\n"


def render_routing(result: dict, args, head: list[str]) -> str:
    lines = head + [
        f"{args.rate:g} req/s per node.",
        "",
        "| policy | prefix hit rate | paid TTFT p50 (ms) | worst TTFT p99 (ms) | worst ITL p99 (ms) | "
        "output tok/s | busy | preemptions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['policy']} | {r['prefix_hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {r['itl_p99_ms']:.1f} | {r['output_tok_s']:.0f} | {r['busy']:.0%} | "
            f"{r['preemptions']} |"
        )
    return "\n".join(lines) + "\n"


CONFIGS = {
    "capacity": "bench/sim/capacity.yaml",
    "routing": "bench/sim/capacity.yaml",
    "overload": "bench/sim/overload.yaml",
    "autoscale": "bench/sim/autoscale.yaml",
    "disagg": "bench/sim/disagg.yaml",
}


def experiments() -> dict:
    """name -> (run(base, args) -> result, render(result, args, head) -> markdown, plot(result, args, path))."""
    import sim_disagg
    import sim_dynamic
    import sim_plots

    return {
        "capacity": (capacity, render_capacity, lambda r, a, p: sim_plots.capacity(r, p, a.ttft_p99, a.itl_p99)),
        "routing": (routing, render_routing, lambda r, a, p: sim_plots.routing(r, p)),
        "overload": (
            sim_dynamic.overload,
            sim_dynamic.render_overload,
            lambda r, a, p: sim_plots.overload(r["runs"], p),
        ),
        "autoscale": (
            sim_dynamic.autoscale,
            sim_dynamic.render_autoscale,
            lambda r, a, p: sim_plots.autoscale(r["runs"], p),
        ),
        "disagg": (sim_disagg.experiment, sim_disagg.render, lambda r, a, p: sim_plots.disagg(r, p)),
    }


def redraw(table: dict) -> None:
    for name, (_, _, plot) in table.items():
        path = ROOT / f"docs/benchmarks/sim_{name}.json"
        if path.exists():
            saved = json.loads(path.read_text())
            args = argparse.Namespace(**saved.get("args", {}))
            print(plot(saved, args, path.with_suffix(".png")))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=(*CONFIGS, "plots"))
    p.add_argument("--config", default=None, help="default: bench/sim/EXPERIMENT.yaml (capacity.yaml for routing)")
    p.add_argument("--rates", default="20,25,30,35,40", help="capacity: arrival rates per node, req/s")
    p.add_argument("--rate", type=float, default=30.0, help="routing: arrival rate per node, req/s")
    p.add_argument("--ttft-p99", type=float, default=2.0)
    p.add_argument("--itl-p99", type=float, default=0.1)
    p.add_argument("--bin-s", type=float, default=None, help="overload, autoscale: timeline bins (s)")
    p.add_argument("--sample-s", type=float, default=5.0, help="overload: gauge samples (s)")
    p.add_argument("--loads", default=None, help="disagg: offered req/s per GPU, comma-separated")
    p.add_argument("--out", default=None, help="default: docs/benchmarks/sim_EXPERIMENT.md ('' prints only)")
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="capacity, routing: simulations run at once, each in its own process",
    )
    args = p.parse_args()
    if args.bin_s is None:
        args.bin_s = 60.0 if args.experiment == "autoscale" else 10.0
    return args


def main() -> int:
    args = parse_args()
    table = experiments()
    if args.experiment == "plots":
        redraw(table)
        return 0
    args.config = args.config or CONFIGS[args.experiment]
    base = yaml.safe_load((ROOT / args.config).read_text())
    run, render, plot = table[args.experiment]
    result = run(base, args)
    out = f"docs/benchmarks/sim_{args.experiment}.md" if args.out is None else args.out
    head = [
        f"# Simulator experiment: {args.experiment}",
        "",
        f"`python {' '.join(sys.argv)}` ({time.strftime('%Y-%m-%d')}), base config `{args.config}`: "
        f"{base['fleet']}, {base['duration_s']} s of arrivals after a {base.get('warmup_s', 0)} s warm-up, seed "
        f"{base['seed']}.",
        "",
    ]
    if out:
        png = (ROOT / out).with_suffix(".png")
        plot(result, args, png)
        head += [f"![{args.experiment}]({png.name})", ""]
    text = render(result, args, head)
    print(text)
    if out:
        (ROOT / out).write_text(text)
        (ROOT / out).with_suffix(".json").write_text(json.dumps({"args": vars(args), **result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
