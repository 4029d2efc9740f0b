#!/usr/bin/env python3
"""How fast the fleet simulator runs: simulated requests per minute of wall time and of CPU time.

    python bench/simulator_speed.py                                   # report: docs/benchmarks/simulator_speed.md
    python bench/simulator_speed.py --configs bench/sim/flagship.yaml --out ''
    python bench/simulator_speed.py --against 76e7fbd --pairs 4      # the code at 76e7fbd vs this checkout

For each config: the run's wall and CPU time (process time, which other processes on a shared machine cannot
inflate), requests simulated (every turn that arrived), engine steps, and what share of steps ran in full
(parked decodes rejoining the scheduler). Target (issue 7): at least 100,000 simulated requests per minute.
Every run is made in a fresh process, as `tokenfleet simulate` makes one simulation per process.

`--against REV`: this machine's speed drifts by tens of percent within an hour, so a speed change is measured by
running the code at REV (a temporary `git worktree`) and this checkout's code alternately, each run in a fresh
process, on the same configs: CPU time of each pair, their ratio, and whether the two reports are byte-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

try:
    from _cpuprobe import CpuProbe  # noqa: E402
except ImportError:  # pragma: no cover
    CpuProbe = None


REFERENCE_REPEATS = 5


def reference_loop_s(repeats: int = REFERENCE_REPEATS) -> float:
    """This machine's Python speed at the moment: the median time of a fixed loop of 10 million additions. The
    machine's speed differs from day to day (the same simulation took 10 s one day and 23 s another), so a report
    quotes it beside its numbers: requests per minute scale inversely with it."""
    times = []
    for _ in range(repeats):
        began, total = time.perf_counter(), 0
        for i in range(10_000_000):
            total += i
        times.append(time.perf_counter() - began)
    return round(sorted(times)[repeats // 2], 3)


def measure_repeated(path: str, seed: int, repeats: int) -> dict:
    """The run `repeats` times: the median run's row, with every run's wall time (this machine's speed varies
    by +-15% from one run to the next even when it is otherwise idle)."""
    runs = sorted((measure(path, seed) for _ in range(repeats)), key=lambda r: r["wall_s"])
    return {
        **runs[len(runs) // 2],
        "wall_s_runs": [r["wall_s"] for r in runs],
        "per_wall_minute_runs": [r["per_wall_minute"] for r in runs],
    }


def measure(path: str, seed: int) -> dict:
    """One run in a fresh process, as `tokenfleet simulate` runs one simulation per process: runs made one after
    another in one process got slower on the 8B fleet (13 s, 14 s, 15 s: the heap the earlier runs left)."""
    probe = CpuProbe() if CpuProbe else None
    if probe:
        probe.start()
    began = time.perf_counter()
    run = one_run(ROOT, path, seed)
    others = probe.stop(time.perf_counter() - began) if probe else None
    wall, cpu = run["wall_s"], run["cpu_s"]
    return {
        "config": path,
        "setup": run["setup"],
        "requests": run["requests"],
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "per_wall_minute": round(run["requests"] / wall * 60),
        "per_cpu_minute": round(run["requests"] / cpu * 60),
        "steps": run["steps"],
        "full_steps": run["full_steps"],
        "simulated_s": round(run["simulated_s"], 1),
        "other_cpu_share": others,
    }


# One run with the code of the checkout it runs in: its times, what it simulated, and the digest of its report
# (built with wall time 0, so that the same decisions give the same digest).
_ONE_RUN = """
import hashlib, json, sys, time
from tokenfleet.sim import config
from tokenfleet.sim.fleet import Fleet
from tokenfleet.sim.report import build_report
setup = config.load(sys.argv[1], int(sys.argv[2]))
wall, cpu = time.perf_counter(), time.process_time()
fleet = Fleet(setup).run()
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
report = build_report(fleet, 0.0)
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "requests": fleet.requests_seen, "setup": report["setup"],
                  "steps": report["totals"]["engine_steps"], "full_steps": report["totals"]["full_steps"],
                  "simulated_s": fleet.clock.now,
                  "digest": hashlib.sha256(json.dumps(report, sort_keys=True).encode()).hexdigest()}))
"""


def one_run(checkout: Path, path: str, seed: int) -> dict:
    config_path = Path(path) if Path(path).is_absolute() else ROOT / path  # this checkout's config, for both
    out = subprocess.run(
        [sys.executable, "-c", _ONE_RUN, str(config_path), str(seed)],
        cwd=checkout,
        env={**os.environ, "PYTHONPATH": str(checkout)},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(rev: str, paths: list[str], seed: int, pairs: int) -> str:
    """The code at `rev` against this checkout, alternately, `pairs` runs each per config (a markdown table)."""
    lines = [
        f"`python {' '.join(sys.argv)}` ({time.strftime('%Y-%m-%d %H:%M')}): CPU seconds per run, {rev} "
        "and this checkout alternately",
        "",
        "| config | old s | new s | new / old | median | same report |",
        "|---|---|---|---|---:|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old_tree), rev], cwd=ROOT, check=True)
        try:
            for path in paths:
                runs = [(one_run(old_tree, path, seed), one_run(ROOT, path, seed)) for _ in range(pairs)]
                old_s, new_s = [old["cpu_s"] for old, _ in runs], [new["cpu_s"] for _, new in runs]
                ratios = [new / old for old, new in zip(old_s, new_s)]
                same = all(old["digest"] == new["digest"] for old, new in runs)
                lines.append(
                    f"| `{path}` | {', '.join(f'{s:.2f}' for s in old_s)} | "
                    f"{', '.join(f'{s:.2f}' for s in new_s)} | "
                    f"{', '.join(f'{r:.3f}' for r in ratios)} | "
                    f"{statistics.median(ratios):.3f} | {'yes' if same else 'NO'} |"
                )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=True)
    return "\n".join(lines)


def render(result: dict) -> str:
    reference = result.get("reference_loop_s")
    machine = result["machine"] + (
        ""
        if reference is None
        else f"; reference loop {reference} s, the median of "
        f"{result['reference_loop_runs']} (bench/simulator_speed.py reference_loop_s)"
    )
    lines = [
        "# Simulator speed",
        "",
        f"`{result['command']}` ({result['date']}; {machine})",
        "",
        "| config | fleet | requests | simulated s | wall s | CPU s | requests / wall min | requests / CPU min "
        "| steps (full) | other CPU | runs: requests / wall min |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["runs"]:
        s = r["setup"]
        fleet = f"{s['replicas']} x {s['model']} {s['weight_dtype']} TP{s['tensor_parallel']} {s['gpu']}"
        other = "-" if r["other_cpu_share"] is None else f"{r['other_cpu_share']:.0%}"
        lines.append(
            f"| `{r['config']}` | {fleet} | {r['requests']} | {r['simulated_s']} | {r['wall_s']} | "
            f"{r['cpu_s']} | {r['per_wall_minute']:,} | {r['per_cpu_minute']:,} | {r['steps']:,} "
            f"({r['full_steps']:,}) | {other} | {', '.join(f'{x:,}' for x in r.get('per_wall_minute_runs', []))} |"
        )
    return "\n".join(lines + [""] + result.get("notes", []))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="bench/sim/flagship.yaml,bench/sim/speed.yaml")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="runs per config; the median run is reported")
    p.add_argument("--out", default="docs/benchmarks/simulator_speed.md")
    p.add_argument("--against", metavar="REV", help="A/B: the code at this git revision against this checkout")
    p.add_argument("--pairs", type=int, default=4, help="with --against: runs of each per config")
    args = p.parse_args()
    if args.against:
        print(compare(args.against, args.configs.split(","), args.seed, args.pairs))
        return 0
    before = reference_loop_s()
    runs = [measure_repeated(path, args.seed, args.repeats) for path in args.configs.split(",")]
    after = reference_loop_s()
    result = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "reference_loop_s": round((before + after) / 2, 3),
        "reference_loop_runs": f"{REFERENCE_REPEATS} before ({before} s) and {REFERENCE_REPEATS} after ({after} s)",
        "runs": runs,
    }
    print(render(result))
    if args.out:
        out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
        out.write_text(render(result) + "\n")
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
