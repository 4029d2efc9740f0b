"""`tokenfleet simulate`: load and check the config, run, print the summary, write report.json + summary.txt."""

from __future__ import annotations

import argparse
import logging
import time
from contextlib import nullcontext

from tokenfleet.sim import config
from tokenfleet.sim.autoscaling import ScaledFleet
from tokenfleet.sim.progress import Progress
from tokenfleet.sim.report import build_report, disagg_report, scaling_report, summary, write


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="simulation YAML (see deploy/sim.example.yaml)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: the config's seed, else 0)")
    parser.add_argument("--out", default=None, help="folder for report.json and summary.txt (default: print only)")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr while it runs")


def run_simulate_command(args: argparse.Namespace) -> int:
    sim = config.load_simulation(args.config, seed=args.seed)  # every config mistake is a ValueError here
    logging.getLogger("tokenfleet.dispatch.overload").setLevel(logging.ERROR)  # the report counts level changes
    started = time.perf_counter()
    fleet = sim.fleet()
    with nullcontext() if args.quiet else Progress(fleet):
        scaled = ScaledFleet(fleet, sim.scaling).run() if sim.scaling else fleet.run()
    report = build_report(fleet, time.perf_counter() - started)
    if sim.scaling:
        report["autoscaling"] = scaling_report(scaled)
        report["totals"]["gpu_hours"] = report["autoscaling"]["gpu_hours"]
    if sim.disagg:
        report["disaggregated"] = disagg_report(fleet)
    print(summary(report))
    if args.out:
        print(f"wrote {write(report, args.out)}/report.json")
    return 0
