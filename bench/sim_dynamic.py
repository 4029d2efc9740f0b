"""The overload and autoscaling experiments of bench/sim_experiments.py: runs over time, with the timeline of
tokenfleet/sim/timeline.py and the real autoscaler driving the fleet (tokenfleet/sim/autoscaling.py)."""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import asdict

from tokenfleet.autoscale.settings import AutoscaleSettings
from tokenfleet.sim import config
from tokenfleet.sim.autoscaling import ScaledFleet, ScalingSetup
from tokenfleet.sim.fleet import Fleet
from tokenfleet.sim.report import tier_report
from tokenfleet.sim.timeline import Sampler, TimelineMetrics, fleet_gauges, percentile

INTERACTIVE = ("enterprise", "paid", "free")
TIERS = ("enterprise", "paid", "free", "batch")


def timeline_fleet(raw: dict, bin_s: float) -> Fleet:
    setup = config.parse(raw)
    fleet = Fleet(setup)
    fleet.metrics = TimelineMetrics(setup.slo, setup.warmup_s, bin_s)
    return fleet


def window_ttft(metrics: TimelineMetrics, tier: str, start: float, end: float) -> dict:
    """TTFT percentiles of the tier's requests that arrived in [start, end)."""
    values = [
        v
        for i, tiers in metrics.bins.items()
        if start <= i * metrics.bin_s < end
        for v in (tiers[tier].ttft if tier in tiers else ())
    ]
    return {"p50_s": percentile(values, 50), "p99_s": percentile(values, 99), "n": len(values)}


def tier_outcomes(fleet: Fleet, spike: tuple[float, float], seconds: float) -> dict:
    metrics: TimelineMetrics = fleet.metrics
    out = {}
    for tier in TIERS:
        if tier not in metrics.tiers:
            continue
        total, full = metrics.totals((tier,)), tier_report(metrics.tiers[tier], seconds)
        out[tier] = {
            "arrived": total.arrived,
            "shed": total.shed,
            "capped": total.capped,
            "delayed": total.delayed,
            "completed": total.completed,
            "good": total.good,
            "queue_wait_p99_ms": full["queue_wait_ms"]["p99"],
            "itl_p99_ms": full["itl_ms"]["p99"],
            "ttft_all": window_ttft(metrics, tier, 0, 1e18),
            "ttft_spike": window_ttft(metrics, tier, *spike),
        }
    return out


# --- overload -------------------------------------------------------------------------------------------------


def overload_run(raw: dict, args) -> dict:
    started = time.process_time()
    fleet = timeline_fleet(raw, args.bin_s)
    sampler = Sampler(fleet.events, args.sample_s, lambda: fleet_gauges(fleet), fleet.end_s)
    fleet.run()
    bursts = raw["workload"]["bursts"]
    spike = (min(b["at_s"] for b in bursts), max(b["at_s"] + b["duration_s"] for b in bursts))
    return {
        "tiers": tier_outcomes(fleet, spike, raw["duration_s"]),
        "spike_s": spike,
        "level_seconds": [round(x, 1) for x in fleet.level_seconds],
        "max_level": fleet.max_level,
        "unfinished": fleet.in_flight + fleet.gateway.queued,
        "cpu_s": round(time.process_time() - started, 1),
        "bins": fleet.metrics.rows(),
        "samples": sampler.samples,
    }


def overload(base: dict, args) -> dict:
    runs = {}
    for name in ("ladder", "no ladder"):
        raw = copy.deepcopy(base)
        if name == "no ladder":  # the thresholds out of reach: nothing paused, capped or shed; paid never queued
            raw.setdefault("gateway", {})["overload"] = {"ttft_target_s": 1e9}
        runs[name] = overload_run(raw, args)
        print(name, {t: (v["shed"], v["ttft_spike"]) for t, v in runs[name]["tiers"].items()}, file=sys.stderr)
    return {"runs": runs}


# --- autoscaling ----------------------------------------------------------------------------------------------


def autoscale_run(raw: dict, scaling: dict, mode: str, bin_s: float) -> dict:
    started = time.process_time()
    raw = copy.deepcopy(raw)
    if mode == "static":
        raw["fleet"]["replicas"] = scaling["static_replicas"]
    fleet = timeline_fleet(raw, bin_s)
    if mode == "static":
        fleet.run()
        gpus = len(fleet.replicas) * fleet.setup.gpus_per_replica
        gpu_hours, records, events = gpus * fleet.clock.now / 3600, [], {}
    else:
        settings = AutoscaleSettings(**{**scaling["settings"], "mode": mode})
        run = ScaledFleet(fleet, ScalingSetup(settings, cold_start_s=scaling["cold_start_s"])).run()
        records = [{k: v for k, v in asdict(r).items() if k != "reason"} for r in run.records]
        gpu_hours, events = run.gpu_hours, run.events
    return {
        "gpu_hours": round(gpu_hours, 3),
        "events": events,
        **slo_summary(fleet),
        "peak_replicas": max(
            (r["ready"] + r["starting"] + r["draining"] for r in records), default=len(fleet.replicas)
        ),
        "cpu_s": round(time.process_time() - started, 1),
        "records": records,
        "bins": fleet.metrics.rows(),
    }


def slo_summary(fleet: Fleet) -> dict:
    metrics: TimelineMetrics = fleet.metrics
    total = metrics.totals(INTERACTIVE)
    seconds = fleet.setup.duration_s - fleet.setup.warmup_s
    reports = {t: tier_report(metrics.tiers[t], seconds) for t in INTERACTIVE if t in metrics.tiers}
    misses = total.missed + total.shed + total.quota + total.rejected
    return {
        "interactive_arrived": total.arrived,
        "completed": total.completed,
        "slo_misses": misses,
        "missed_completed": total.missed,
        "shed": total.shed,
        "miss_share": round(misses / max(total.arrived - total.cancelled, 1), 5),
        "ttft_p99_ms": {t: r["ttft_ms"]["p99"] for t, r in reports.items()},
        "itl_p99_ms": {t: r["itl_ms"]["p99"] for t, r in reports.items()},
        "unfinished": fleet.in_flight + fleet.gateway.queued,
    }


def autoscale(base: dict, args) -> dict:
    base = copy.deepcopy(base)
    scaling = {**base.pop("autoscale"), **base.pop("experiment")}
    runs = {}
    for mode in ("forecast", "reactive"):
        runs[mode] = autoscale_run(base, scaling, mode, args.bin_s)
        print(mode, {k: v for k, v in runs[mode].items() if k not in ("records", "bins")}, file=sys.stderr)
    static_hours = scaling["static_replicas"] * (base["duration_s"] + base.get("drain_s", 120)) / 3600
    return {
        "runs": runs,
        "scaling": scaling,
        "static_gpu_hours": round(static_hours, 3),
        "day_factor": 86400 / base["workload"]["diurnal_period_s"],
    }


# --- reports ---------------------------------------------------------------------------------------------------


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}" if value < 10 else f"{value:.0f}"


def render_overload(result: dict, args, head: list[str]) -> str:
    lines = list(head)
    for name, run in result["runs"].items():
        spike = run["spike_s"]
        lines += [
            f"## {name}",
            "",
            f"Seconds at ladder levels 0-4: {run['level_seconds']} (max level "
            f"{run['max_level']}); unfinished at the end: {run['unfinished']}.",
            "",
            f"| tier | arrived | shed (429) | max_tokens capped | delayed in queue | queue wait p99 (ms) | "
            f"TTFT p50 / p99 (s), all | TTFT p50 / p99 (s), arrived {spike[0]:g}-{spike[1]:g} s | "
            f"ITL p99 (ms) | within SLO |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for tier, t in run["tiers"].items():
            a, w = t["ttft_all"], t["ttft_spike"]
            lines.append(
                f"| {tier} | {t['arrived']} | {t['shed']} | {t['capped']} | {t['delayed']} | "
                f"{_s(t['queue_wait_p99_ms'])} | {_s(a['p50_s'])} / {_s(a['p99_s'])} | "
                f"{_s(w['p50_s'])} / {_s(w['p99_s'])} | {_s(t['itl_p99_ms'])} | "
                f"{t['good'] / max(t['arrived'], 1):.0%} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def render_autoscale(result: dict, args, head: list[str]) -> str:
    scaling = result["scaling"]
    lines = list(head) + [
        f"Cold start {scaling['cold_start_s']:g} s; policy settings {scaling['settings']}; the static fleet has "
        f"{scaling['static_replicas']} replicas. SLO miss: an interactive request completed outside its tier's TTFT "
        "target or the time-per-output-token target, or shed / refused.",
        "",
        f"| mode | GPU-hours (compressed day) | per real day (x{result['day_factor']:g}) | peak replicas | starts | "
        "SLO misses | miss share | worst TTFT p99 (ms) | worst ITL p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, r in result["runs"].items():
        lines.append(
            f"| {mode} | {r['gpu_hours']:.2f} | {r['gpu_hours'] * result['day_factor']:.1f} | "
            f"{r['peak_replicas']} | "
            f"{r['events'].get('started', '-')} | {r['slo_misses']} | {r['miss_share']:.2%} | "
            f"{max(v for v in r['ttft_p99_ms'].values() if v is not None):.0f} | "
            f"{max(v for v in r['itl_p99_ms'].values() if v is not None):.1f} |"
        )
    hours = result["static_gpu_hours"]
    lines.append(
        f"| static, {scaling['static_replicas']} replicas (not run) | {hours:.2f} | "
        f"{hours * result['day_factor']:.1f} | {scaling['static_replicas']} | - | - | - | - | - |"
    )
    return "\n".join(lines) + "\n"
