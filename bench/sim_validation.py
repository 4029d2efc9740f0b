#!/usr/bin/env python3
"""The simulator against the real engine on this machine (issue 7: "within 15%").

    python bench/sim_validation.py                       # report: docs/benchmarks/simulator_validation.md + .json
    python bench/sim_validation.py --out ''              # print only

1. Writes the demo checkpoint (--size, default small) and starts the real engine on the CPU with a small KV cache
   (--kv-cache-gib) so that requests get preempted.
2. Calibration: replays a calibration workload (its own seed) on the engine in real time, records every step's
   batch (tokens, attention pairs, KV tokens read, sequences, swapped blocks) and measured duration, and fits the
   cost model's coefficients (tokenfleet/sim/calibration.py: least squares, non-negative).
3. Validation: for each --rates value, a fresh engine replays a different workload (Poisson arrivals, shared system
   prompts, outputs of varied length, two priority classes) in real time; the simulator runs the same arrivals
   on one replica with the same engine settings and the calibrated cost model. Compared: TTFT mean / p50 / p90,
   throughput (output tokens / time to the last completion) and preemptions. Target: within 15%.
4. The simulator is deterministic; the real engine is not. Its step times scatter about 5-10% around the cost
   model, and its average speed drifts by a few percent between runs minutes apart (the machine, not the code).
   Near the KV limit the TTFT tail and the preemption count are steep in both: repeated real runs of one workload
   spread by tens of percent. So the comparison that decides is run by run: each real run against simulations
   with the calibrated cost model scaled to that run's measured average speed (one number: its measured over
   predicted step time) and carrying the calibration's measured step scatter (calibration.ScatteredCostModel,
   --scatter-seeds seeds); the means over runs are compared. The plain simulation at the calibration's speed, and
   one refitted on the runs' own steps, are shown beside it.
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
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tokenfleet.config import EngineConfig  # noqa: E402
from tokenfleet.engine.engine import Engine  # noqa: E402
from tokenfleet.engine.scheduler import SchedulerConfig  # noqa: E402
from tokenfleet.model.demo import write_demo_checkpoint  # noqa: E402
import torch  # noqa: E402

from tokenfleet.sim.calibration import (Arrival, Measured, ProfiledCostModel, ScatteredCostModel,  # noqa: E402
                                        fit, fit_error, replay, residual_ratios, simulate, speed_profile,
                                        synthetic_arrivals)
from tokenfleet.sim.events import SimClock  # noqa: E402
from tokenfleet.sim.cost_model import CostModel, StepCoefficients  # noqa: E402
from tokenfleet.sim.replica import ReplicaSpec  # noqa: E402

try:
    from _cpuprobe import CpuProbe  # noqa: E402
except ImportError:  # pragma: no cover
    CpuProbe = None


CLOCK = "cpu"


def workload(seed: int, n: int, rate: float, vocab: int) -> list[Arrival]:
    return synthetic_arrivals(seed, n, rate, vocab)


def engine_options(args) -> dict:
    return dict(kv_cache_gib=args.kv_cache_gib, swap_space_gib=args.swap_space_gib, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048)


def fresh_engine(model: Path, args) -> Engine:
    engine = Engine(EngineConfig.from_options(str(model), **engine_options(args)))
    warm = Arrival("warm", 0.0, list(range(10, 300)), 8)
    replay(engine, [warm], CLOCK)  # kernels built and warmed; a prompt no workload shares
    return engine


def summarize(m: Measured) -> dict:
    ttfts = sorted(m.ttft.values())
    return {"ttft_mean_s": statistics.fmean(ttfts), "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p90_s": ttfts[int(0.9 * len(ttfts))], "throughput_tok_s": m.output_tokens / max(m.finished.values()),
            "preemptions": m.preemptions, "completed": len(m.finished)}


def compare(real: dict, sim: dict) -> dict:
    keys = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "throughput_tok_s", "preemptions")
    return {k: (sim[k] - real[k]) / real[k] if real[k] else (0.0 if sim[k] == real[k] else float("inf"))
            for k in keys}


def calibrate(model: Path, args) -> tuple:
    engine = fresh_engine(model, args)
    vocab = engine.model_config.vocab_size
    batches, durations = [], []
    # two regimes, like the validation runs: an offline batch (large batches) and Poisson arrivals (small ones)
    for seed, rate in ((args.seed + 1000, float("inf")), (args.seed + 2000, args.calibration_rate)):
        measured = replay(engine, workload(seed, args.calibration_requests, rate, vocab), CLOCK)
        batches += measured.batches
        durations += measured.durations
    coefficients = fit(batches, durations)
    print("calibration fit:", fit_error(coefficients, batches, durations), file=sys.stderr)
    ratios = residual_ratios(coefficients, batches, durations)
    spec = ReplicaSpec(engine.blocks.num_blocks, engine.config.block_size, len(engine.blocks.free_host),
                       engine.config.watermark, True, engine.max_model_len,
                       SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens,
                                       engine.config.swap_threshold_tokens))
    return coefficients, ratios, spec, vocab, len(durations)


def mean_of(rows: list[dict]) -> tuple[dict, dict]:
    """The mean of each metric over runs, and how far apart the runs were (max - min, relative to the mean)."""
    mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
    spread = {k: (max(r[k] for r in rows) - min(r[k] for r in rows)) / mean[k] if mean[k] else 0.0 for k in mean}
    return mean, spread


def scaled(coefficients: StepCoefficients, factor: float) -> StepCoefficients:
    """The same cost model on a machine `factor` times slower (every time coefficient scaled)."""
    return StepCoefficients(**{k: v * factor if isinstance(v, float) else v
                               for k, v in asdict(coefficients).items()})


def speed_of(measured: Measured, coefficients: StepCoefficients) -> float:
    """A run's measured step time over the calibrated model's prediction for the same steps."""
    model = CostModel(coefficients)
    return sum(measured.durations) / sum(model.step_time(b) for b in measured.batches)


def simulate_at_speed(arrivals, spec, coefficients, ratios, speed: float, seeds: int) -> dict:
    """The mean over `seeds` simulations with the measured step scatter, the cost model scaled to `speed`."""
    cost = scaled(coefficients, speed)
    return mean_of([summarize(simulate(arrivals, spec, ScatteredCostModel(cost, ratios, seed)))
                    for seed in range(seeds)])[0]


def validate(model: Path, args, rate: float, coefficients, ratios, spec, vocab: int) -> dict:
    """The real engine `repeats` times (fresh each time; an offline batch once: its schedule does not depend on
    time), against one simulation. `real` is the mean of the repeats; `spread` how far apart they were."""
    arrivals = workload(args.seed, args.requests, rate, vocab)
    probe = CpuProbe() if CpuProbe else None
    if probe:
        probe.start()
    started = time.perf_counter()
    repeats, matched, profiled, batches, durations = [], [], [], [], []
    for _ in range(1 if rate == float("inf") else args.repeats):
        measured = replay(fresh_engine(model, args), arrivals, CLOCK)
        repeats.append({**summarize(measured), "speed": speed_of(measured, coefficients)})
        matched.append(simulate_at_speed(arrivals, spec, coefficients, ratios, repeats[-1]["speed"],
                                         args.scatter_seeds))
        clock = SimClock()
        profile = speed_profile(measured, coefficients, args.profile_window_s)
        profiled.append(summarize(simulate(arrivals, spec, ProfiledCostModel(coefficients, profile, clock), clock)))
        batches, durations = batches + measured.batches, durations + measured.durations
    others = probe.stop(time.perf_counter() - started) if probe else None
    real, spread = mean_of(repeats)
    sim = summarize(simulate(arrivals, spec, CostModel(coefficients)))
    sim_matched, matched_spread = mean_of(matched)
    sim_profiled = mean_of(profiled)[0]
    # the same simulation with the cost model fitted on these runs' own steps: what is left when the step times
    # are right (the scheduling model), apart from what the calibration's step times add
    own = fit(batches, durations)
    sim_own = summarize(simulate(arrivals, spec, CostModel(own)))
    return {"rate": rate, "real": real, "repeats": repeats, "spread": spread, "sim": sim,
            "error": compare(real, sim), "sim_matched": sim_matched, "sim_matched_spread": matched_spread,
            "sim_matched_runs": matched, "error_matched": compare(real, sim_matched),
            "sim_profiled": sim_profiled, "sim_profiled_runs": profiled, "error_profiled": compare(real, sim_profiled),
            "other_cpu_share": others,
            "step_fit": fit_error(coefficients, batches, durations),
            "sim_own_fit": sim_own, "error_own_fit": compare(real, sim_own)}


def render(result: dict) -> str:
    lines = ["# Simulator validation: the simulated replica against the real engine", "",
             f"`{result['command']}` ({result['date']}; {result['machine']})", "",
             f"Checkpoint: demo `{result['size']}`; engine: {result['engine']}; KV cache {result['kv_blocks']} "
             f"blocks of {result['block_size']} tokens, {result['host_blocks']} host blocks. Calibrated on "
             f"{result['calibration_steps']} measured steps of two separate workloads (an offline batch and "
             f"{result['calibration_rate']:g} req/s, other seeds). The real engine's clock: {result['clock']}.", "",
             "```", json.dumps(result["coefficients"], indent=1), "```", "",
             "| rate (req/s) | metric | real engine (mean of runs) | real runs' spread | **simulator at each run's "
             "speed, with step scatter (mean)** | its spread | **difference** | simulator at the calibration's "
             "speed | difference | simulator, refitted on these runs' steps | difference |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in result["runs"]:
        for key in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "throughput_tok_s", "preemptions"):
            real, sim, err = run["real"][key], run["sim"][key], run["error"][key]
            spread = f"{run['spread'][key]:.0%} ({len(run['repeats'])} runs)" if len(run["repeats"]) > 1 else "-"
            own = (f" {run['sim_own_fit'][key]:.4g} | {run['error_own_fit'][key]:+.1%} |" if "sim_own_fit" in run
                   else " - | - |")
            scatter = (f" {run['sim_matched'][key]:.4g} | {run['sim_matched_spread'][key]:.0%} "
                       f"| **{run['error_matched'][key]:+.1%}** |" if "sim_matched" in run else " - | - | - |")
            lines.append(f"| {run['rate']:g} | {key} | {real:.4g} | {spread} |" + scatter
                         + f" {sim:.4g} | {err:+.1%} |" + own)
    lines += ["", "Step-time model on each validation run's measured steps (mean absolute relative error per step; "
              "predicted / measured total): " + "; ".join(
                  f"{r['rate']:g} req/s: {r['step_fit']['mean_abs_rel_error']:.1%}, "
                  f"{r['step_fit']['total_predicted_over_measured']:.3f}" for r in result["runs"])]
    def worst(column: str) -> float:
        return max(abs(e) for run in result["runs"] for e in run[column].values())

    diagnostic = [f"| {r['rate']:g} | {key} | {r['real'][key]:.4g} | {r['sim_profiled'][key]:.4g} | "
                  f"{r['error_profiled'][key]:+.1%} |" for r in result["runs"] if "sim_profiled" in r
                  for key in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "throughput_tok_s", "preemptions")]
    if diagnostic:
        lines += ["", "Diagnostic, not the comparison that decides: each real run against a simulation whose step times "
                  "follow that run's measured speed over time (measured / predicted per window of "
                  f"{result.get('profile_window_s', 2.0):g} s of the engine's clock; calibration.ProfiledCostModel), "
                  "means over runs. What it closes of the gap is the machine's speed changing during a run.", "",
                  "| rate (req/s) | metric | real engine | simulator following the run's speed | difference |",
                  "|---:|---|---:|---:|---:|"] + diagnostic
    speeds = "; ".join(f"{r['rate']:g} req/s: " + ", ".join(f"{x['speed']:.3f}" for x in r["repeats"])
                       for r in result["runs"])
    lines += ["", f"Each real run's speed (its measured / predicted step time): {speeds}.",
              "", f"Largest difference, real runs against simulations at each run's speed with step scatter "
              f"(means over runs): **{worst('error_matched'):.1%}** (target: within 15%); against the "
              f"simulation at the calibration's speed: {worst('error'):.1%}. Other processes' CPU during the real runs: "
              + ", ".join("-" if r["other_cpu_share"] is None else f"{r['other_cpu_share']:.0%}"
                          for r in result["runs"]) + " of the machine.", ""]
    return "\n".join(lines + result.get("notes", []))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="medium")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--rates", default="inf,1.2", help="validation arrival rates, requests/s (inf: an offline batch)")
    p.add_argument("--calibration-requests", type=int, default=60)
    p.add_argument("--calibration-rate", type=float, default=1.2)
    p.add_argument("--kv-cache-gib", type=float, default=0.04)
    p.add_argument("--swap-space-gib", type=float, default=0.01)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5, help="real-engine runs per Poisson rate (their mean is compared)")
    p.add_argument("--profile-window-s", type=float, default=2.0,
                   help="diagnostic column: the run's speed measured per window of this many seconds")
    p.add_argument("--scatter-seeds", type=int, default=10,
                   help="simulations with the measured step-time scatter per real run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/benchmarks/simulator_validation.md")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="the real engine's time: its thread's CPU time (default; a shared machine) or wall time")
    args = p.parse_args()
    global CLOCK
    CLOCK = args.clock
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_demo_checkpoint(Path(tmp) / args.size, size=args.size)
        coefficients, ratios, spec, vocab, steps = calibrate(model, args)
        runs = [validate(model, args, float(r), coefficients, ratios, spec, vocab) for r in args.rates.split(",")]
    import platform
    result = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores",
              "size": args.size, "engine": engine_options(args), "kv_blocks": spec.num_blocks,
              "block_size": spec.block_size, "host_blocks": spec.num_host_blocks, "calibration_steps": steps,
              "calibration_rate": args.calibration_rate, "clock": args.clock,
              "coefficients": asdict(coefficients), "runs": runs, "profile_window_s": args.profile_window_s}
    print(render(result))
    if args.out:
        out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
        out.write_text(render(result))
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
