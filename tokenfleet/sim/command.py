"""`tokenfleet simulate`: load and check the config, run, print the summary, write report.json + summary.txt."""
from __future__ import annotations

import argparse
import logging
import time

from tokenfleet.sim import config
from tokenfleet.sim.fleet import Fleet
from tokenfleet.sim.report import build_report, summary, write


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="simulation YAML (see deploy/sim.example.yaml)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: the config's seed, else 0)")
    parser.add_argument("--out", default=None, help="folder for report.json and summary.txt (default: print only)")


def run_simulate_command(args: argparse.Namespace) -> int:
    setup = config.load(args.config, seed=args.seed)  # every config mistake is a ValueError here, before the run
    logging.getLogger("tokenfleet.dispatch.overload").setLevel(logging.ERROR)  # the report counts level changes
    started = time.perf_counter()
    fleet = Fleet(setup).run()
    report = build_report(fleet, time.perf_counter() - started)
    print(summary(report))
    if args.out:
        print(f"wrote {write(report, args.out)}/report.json")
    return 0
