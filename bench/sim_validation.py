#!/usr/bin/env python3
"""The simulator against the real engine on this machine (issue 7: "within 15%").

    python bench/sim_validation.py                       # report: docs/benchmarks/simulator_validation.md + .json
    python bench/sim_validation.py --out ''              # print only

1. Writes the demo checkpoint (--size, default medium) and starts the real engine on the CPU with a small KV cache
   (--kv-cache-gib) so that requests get preempted.
2. Calibration: replays an offline batch and then Poisson arrivals (their own seeds) on the engine in real time,
   records every step's batch (tokens, attention pairs, KV tokens read, sequences, swapped blocks) and measured
   duration, and fits the cost model's coefficients (tokenfleet/sim/calibration.py: least squares, non-negative).
   The offline batch also measures what the engine sustains (req/s): --loads are fractions of it, so a slower or
   faster machine is validated at the same load rather than at the same absolute rate.
3. Validation: for each load, a fresh engine replays a different workload (Poisson arrivals, shared system
   prompts, outputs of varied length, two priority classes) in real time; the simulator runs the same arrivals
   on one replica with the same engine settings and the calibrated cost model. Compared: TTFT mean / p50 / p90,
   throughput (output tokens / time to the last completion) and preemptions. Target: within 15%.
4. The simulator is deterministic; the real engine is not. Its step times scatter about 5-10% around the cost
   model, the machine's speed drifts within a run (slow stretches of seconds) and between runs minutes apart.
   Near the KV limit the TTFT tail and the preemption count are steep in both: repeated real runs of one workload
   spread by tens of percent. So the comparison that decides is run by run: each real run against --scatter-seeds
   simulations with the calibrated cost model scaled to that run's measured average speed (its measured over
   predicted step time) and carrying the timing noise measured while calibrating (calibration.DriftingCostModel:
   the calibration's sequence of per-window speeds from a seeded start, and each step's scatter within its
   window); the means over runs are compared. Beside it: step scatter only (ScatteredCostModel), the plain
   simulation at the calibration's speed, and two diagnostics (following the run's own measured speed over time;
   refitted on the runs' own steps).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the engine single-threaded: its CPU time is then its step time

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from tokenfleet.engine.config import EngineConfig  # noqa: E402
from tokenfleet.engine.engine import Engine  # noqa: E402
from tokenfleet.engine.scheduler import SchedulerConfig  # noqa: E402
from tokenfleet.model.demo import write_demo_checkpoint  # noqa: E402
from tokenfleet.sim.calibration import (  # noqa: E402
    Arrival,
    DriftingCostModel,
    MachineNoise,
    Measured,
    ProfiledCostModel,
    ScatteredCostModel,
    fit,
    fit_error,
    machine_noise,
    replay,
    residual_ratios,
    simulate,
    speed_profile,
    synthetic_arrivals,
)
from tokenfleet.sim.cost_model import CostModel, StepCoefficients  # noqa: E402
from tokenfleet.sim.events import SimClock  # noqa: E402
from tokenfleet.sim.replica import ReplicaSpec  # noqa: E402

try:
    from _cpuprobe import CpuProbe  # noqa: E402
except ImportError:  # pragma: no cover
    CpuProbe = None


CLOCK = "cpu"


def workload(seed: int, n: int, rate: float, vocab: int) -> list[Arrival]:
    return synthetic_arrivals(seed, n, rate, vocab)


def engine_options(args) -> dict:
    return dict(
        kv_cache_gib=args.kv_cache_gib,
        swap_space_gib=args.swap_space_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=2048,
    )


def fresh_engine(model: Path, args) -> Engine:
    engine = Engine(EngineConfig.from_options(str(model), **engine_options(args)))
    warm = Arrival("warm", 0.0, list(range(10, 300)), 8)
    replay(engine, [warm], CLOCK)  # kernels built and warmed; a prompt no workload shares
    return engine


def summarize(m: Measured) -> dict:
    ttfts = sorted(m.ttft.values())
    return {
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p90_s": ttfts[int(0.9 * len(ttfts))],
        "throughput_tok_s": m.output_tokens / max(m.finished.values()),
        "preemptions": m.preemptions,
        "completed": len(m.finished),
    }


def compare(real: dict, sim: dict) -> dict:
    keys = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "throughput_tok_s", "preemptions")
    return {k: (sim[k] - real[k]) / real[k] if real[k] else (0.0 if sim[k] == real[k] else float("inf")) for k in keys}


@dataclass
class Calibration:
    coefficients: StepCoefficients
    noise: MachineNoise
    ratios: list[float]  # each step's measured / predicted time, drift included (the step-scatter-only model)
    spec: ReplicaSpec
    vocab: int
    steps: int
    capacity_req_s: float  # what the engine sustains on this workload: the offline batch's output rate over
    # the mean answer length (the Poisson loads are fractions of it, so they mean the same on a slower machine)


def calibrate(model: Path, args) -> Calibration:
    engine = fresh_engine(model, args)
    vocab = engine.model_config.vocab_size
    # two regimes, like the validation runs: an offline batch (large batches) and Poisson arrivals (small ones)
    offline = workload(args.seed + 1000, args.calibration_requests, float("inf"), vocab)
    runs = [replay(engine, offline, CLOCK)]
    capacity = runs[0].output_tokens / runs[0].makespan_s / statistics.fmean(a.max_tokens for a in offline)
    rate = args.calibration_load * capacity
    runs.append(replay(engine, workload(args.seed + 2000, args.calibration_requests, rate, vocab), CLOCK))
    batches = [b for m in runs for b in m.batches]
    durations = [d for m in runs for d in m.durations]
    coefficients = fit(batches, durations)
    print(
        "calibration fit:",
        fit_error(coefficients, batches, durations),
        f"capacity {capacity:.3f} req/s",
        file=sys.stderr,
    )
    spec = ReplicaSpec(
        engine.blocks.num_blocks,
        engine.config.block_size,
        len(engine.blocks.free_host),
        engine.config.watermark,
        True,
        engine.max_model_len,
        SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, engine.config.swap_threshold_tokens),
    )
    return Calibration(
        coefficients,
        machine_noise(coefficients, runs, args.profile_window_s),
        residual_ratios(coefficients, batches, durations),
        spec,
        vocab,
        len(durations),
        capacity,
    )


def mean_of(rows: list[dict]) -> tuple[dict, dict]:
    """The mean of each metric over runs, and how far apart the runs were (max - min, relative to the mean)."""
    mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
    spread = {k: (max(r[k] for r in rows) - min(r[k] for r in rows)) / mean[k] if mean[k] else 0.0 for k in mean}
    return mean, spread


def scaled(coefficients: StepCoefficients, factor: float) -> StepCoefficients:
    """The same cost model on a machine `factor` times slower (every time coefficient scaled)."""
    return StepCoefficients(**{k: v * factor if isinstance(v, float) else v for k, v in asdict(coefficients).items()})


def speed_of(measured: Measured, coefficients: StepCoefficients) -> float:
    """A run's measured step time over the calibrated model's prediction for the same steps."""
    model = CostModel(coefficients)
    return sum(measured.durations) / sum(model.step_time(b) for b in measured.batches)


def simulate_at_speed(arrivals, cal: Calibration, speed: float, seeds: int) -> tuple[dict, dict]:
    """The means over `seeds` simulations with the cost model scaled to `speed`: with the calibration's measured
    step scatter and speed drift (DriftingCostModel), and with its step scatter only (ScatteredCostModel)."""
    cost = scaled(cal.coefficients, speed)
    drifting, scattered = [], []
    for seed in range(seeds):
        clock = SimClock()
        drifting.append(summarize(simulate(arrivals, cal.spec, DriftingCostModel(cost, cal.noise, seed, clock), clock)))
        scattered.append(summarize(simulate(arrivals, cal.spec, ScatteredCostModel(cost, cal.ratios, seed))))
    return mean_of(drifting)[0], mean_of(scattered)[0]


def validate(model: Path, args, load: float, cal: Calibration) -> dict:
    """The real engine `repeats` times (fresh each time; an offline batch once: its schedule does not depend on
    time), against simulations. `real` is the mean of the repeats; `spread` how far apart they were."""
    rate = load * cal.capacity_req_s
    arrivals = workload(args.seed, args.requests, rate, cal.vocab)
    probe = CpuProbe() if CpuProbe else None
    if probe:
        probe.start()
    started = time.perf_counter()
    repeats, matched, scattered, profiled, batches, durations = [], [], [], [], [], []
    for _ in range(1 if rate == float("inf") else args.repeats):
        measured = replay(fresh_engine(model, args), arrivals, CLOCK)
        repeats.append({**summarize(measured), "speed": speed_of(measured, cal.coefficients)})
        drifting, scatter_only = simulate_at_speed(arrivals, cal, repeats[-1]["speed"], args.scatter_seeds)
        matched.append(drifting), scattered.append(scatter_only)
        clock = SimClock()
        profile = speed_profile(measured, cal.coefficients, args.profile_window_s)
        profiled.append(
            summarize(simulate(arrivals, cal.spec, ProfiledCostModel(cal.coefficients, profile, clock), clock))
        )
        batches, durations = batches + measured.batches, durations + measured.durations
    others = probe.stop(time.perf_counter() - started) if probe else None
    real, spread = mean_of(repeats)
    plain = summarize(simulate(arrivals, cal.spec, CostModel(cal.coefficients)))
    sim_matched, matched_spread = mean_of(matched)
    sim_scattered, sim_profiled = mean_of(scattered)[0], mean_of(profiled)[0]
    # the same simulation with the cost model fitted on these runs' own steps: what is left when the step times
    # are right (the scheduling model), apart from what the calibration's step times add
    own = fit(batches, durations)
    sim_own = summarize(simulate(arrivals, cal.spec, CostModel(own)))
    return {
        "load": load,
        "rate": rate,
        "real": real,
        "repeats": repeats,
        "spread": spread,
        "sim_plain": plain,
        "error_plain": compare(real, plain),
        "sim_matched": sim_matched,
        "sim_matched_spread": matched_spread,
        "sim_matched_runs": matched,
        "error_matched": compare(real, sim_matched),
        "sim_scattered": sim_scattered,
        "error_scattered": compare(real, sim_scattered),
        "sim_profiled": sim_profiled,
        "sim_profiled_runs": profiled,
        "error_profiled": compare(real, sim_profiled),
        "other_cpu_share": others,
        "step_fit": fit_error(cal.coefficients, batches, durations),
        "sim_own_fit": sim_own,
        "error_own_fit": compare(real, sim_own),
    }


METRICS = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "throughput_tok_s", "preemptions")


def _label(run: dict) -> str:
    return "offline batch" if run["load"] == float("inf") else f"{run['load']:g} ({run['rate']:.3g} req/s)"


def _row(run: dict, key: str, columns: tuple[str, ...], spreads: bool = False) -> str:
    """One metric of one load: the real mean, then (simulated value, difference) for each column; with `spreads`,
    how far apart the real runs were and the first column's simulations, the first difference in bold."""
    many = len(run["repeats"]) > 1
    cells = [_label(run), key, f"{run['real'][key]:.4g}"]
    if spreads:
        cells.append(f"{run['spread'][key]:.0%} ({len(run['repeats'])} runs)" if many else "-")
    for i, column in enumerate(columns):
        err = f"{run['error_' + column][key]:+.1%}"
        cells.append(f"{run['sim_' + column][key]:.4g}")
        if spreads and i == 0:
            cells += [f"{run['sim_matched_spread'][key]:.0%}" if many else "-", f"**{err}**"]
        else:
            cells.append(err)
    return "| " + " | ".join(cells) + " |"


def render(result: dict) -> str:
    lines = [
        "# Simulator validation: the simulated replica against the real engine",
        "",
        f"`{result['command']}` ({result['date']}; {result['machine']})",
        "",
        f"Checkpoint: demo `{result['size']}`; engine: {result['engine']}; KV cache {result['kv_blocks']} "
        f"blocks of {result['block_size']} tokens, {result['host_blocks']} host blocks. Calibrated on "
        f"{result['calibration_steps']} measured steps of two separate workloads (an offline batch and Poisson "
        f"arrivals at load {result['calibration_load']:g}, other seeds). Load: a fraction of what the engine "
        f"sustains, measured by the calibration's offline batch ({result['capacity_req_s']:.3f} req/s). The real "
        f"engine's clock: {result['clock']}. Timing noise measured while calibrating: the machine's speed in "
        f"{result['drift']['count']} windows of {result['profile_window_s']:g} s, p10 / p50 / p90 "
        f"{result['drift']['p10']:.3f} / {result['drift']['p50']:.3f} / {result['drift']['p90']:.3f}; steps "
        f"within their window, p10 / p50 / p90 {result['step_scatter']['p10']:.3f} / "
        f"{result['step_scatter']['p50']:.3f} / {result['step_scatter']['p90']:.3f}.",
        "",
        "```",
        json.dumps(result["coefficients"], indent=1),
        "```",
        "",
        "| load (rate) | metric | real engine (mean of runs) | real runs' spread | **simulator at each run's "
        "speed, with the measured speed drift and step scatter (mean)** | its spread | **difference** | "
        "... with step scatter only | difference | simulator at the calibration's speed | difference |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_row(r, key, ("matched", "scattered", "plain"), spreads=True) for r in result["runs"] for key in METRICS]
    lines += [
        "",
        "Diagnostics, not the comparison that decides: a simulation whose step times follow each real run's "
        f"measured speed over time (measured / predicted per window of {result['profile_window_s']:g} s of the "
        "engine's clock; calibration.ProfiledCostModel), and one with the cost model refitted on these runs' "
        "own steps. Means over runs.",
        "",
        "| load (rate) | metric | real engine | simulator following the run's speed | difference | simulator "
        "refitted on the runs' steps | difference |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [_row(r, key, ("profiled", "own_fit")) for r in result["runs"] for key in METRICS]
    lines += [
        "",
        "Step-time model on each validation run's measured steps (mean absolute relative error per step; "
        "predicted / measured total): "
        + "; ".join(
            f"{_label(r)}: {r['step_fit']['mean_abs_rel_error']:.1%}, "
            f"{r['step_fit']['total_predicted_over_measured']:.3f}"
            for r in result["runs"]
        ),
    ]
    speeds = "; ".join(f"{_label(r)}: " + ", ".join(f"{x['speed']:.3f}" for x in r["repeats"]) for r in result["runs"])
    worst = {
        c: max(abs(e) for run in result["runs"] for e in run["error_" + c].values())
        for c in ("matched", "scattered", "plain")
    }
    lines += [
        "",
        f"Each real run's speed (its measured / predicted step time): {speeds}.",
        "",
        "Largest difference, real runs against simulations at each run's speed with the measured drift and "
        f"scatter (means over runs): **{worst['matched']:.1%}** (target: within 15%); with step scatter only: "
        f"{worst['scattered']:.1%}; at the calibration's speed: {worst['plain']:.1%}. Other processes' CPU "
        "during the real runs: "
        + ", ".join("-" if r["other_cpu_share"] is None else f"{r['other_cpu_share']:.0%}" for r in result["runs"])
        + " of the machine.",
        "",
    ]
    return "\n".join(lines + result.get("notes", []))


def _deciles(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "p10": ordered[len(ordered) // 10],
        "p50": ordered[len(ordered) // 2],
        "p90": ordered[len(ordered) * 9 // 10],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="medium")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument(
        "--loads",
        default="inf,0.6,0.72",
        help="validation loads: Poisson arrival rates as fractions of what the engine sustains (measured "
        "while calibrating); inf: an offline batch",
    )
    p.add_argument("--calibration-requests", type=int, default=60)
    p.add_argument("--calibration-load", type=float, default=0.72)
    p.add_argument("--kv-cache-gib", type=float, default=0.04)
    p.add_argument("--swap-space-gib", type=float, default=0.01)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5, help="real-engine runs per Poisson rate (their mean is compared)")
    p.add_argument(
        "--profile-window-s",
        type=float,
        default=2.0,
        help="windows of the engine's clock in which the machine's speed is measured (drift, diagnostic)",
    )
    p.add_argument(
        "--scatter-seeds", type=int, default=10, help="simulations with the measured step-time scatter per real run"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/benchmarks/simulator_validation.md")
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="the real engine's time: its thread's CPU time (default; a shared machine) or wall time",
    )
    args = p.parse_args()
    global CLOCK
    CLOCK = args.clock
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_demo_checkpoint(Path(tmp) / args.size, size=args.size)
        cal = calibrate(model, args)
        runs = [validate(model, args, float(load), cal) for load in args.loads.split(",")]
    import platform

    result = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores",
        "size": args.size,
        "engine": engine_options(args),
        "kv_blocks": cal.spec.num_blocks,
        "block_size": cal.spec.block_size,
        "host_blocks": cal.spec.num_host_blocks,
        "calibration_steps": cal.steps,
        "calibration_load": args.calibration_load,
        "capacity_req_s": cal.capacity_req_s,
        "clock": args.clock,
        "coefficients": asdict(cal.coefficients),
        "drift": _deciles(cal.noise.drift),
        "step_scatter": _deciles(cal.noise.ratios),
        "runs": runs,
        "profile_window_s": args.profile_window_s,
    }
    print(render(result))
    if args.out:
        out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
        out.write_text(render(result))
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
