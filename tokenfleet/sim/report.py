"""A finished run as numbers (JSON) and as a short human summary."""

from __future__ import annotations

import json
from pathlib import Path

from tokenfleet.sim.fleet import Fleet
from tokenfleet.sim.metrics import LogHistogram, TierMetrics


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def tier_report(m: TierMetrics, seconds: float) -> dict:
    itl: LogHistogram = m.itl
    return {
        "arrived": m.arrived,
        "completed": m.completed,
        "cancelled": m.cancelled,
        "shed": m.shed,
        "quota_refused": m.quota,
        "rejected": m.rejected,
        "length_refused": m.length,
        "delayed": m.delayed,
        "ttft_ms": {"p50": _ms(_percentile(m.ttft, 50)), "p99": _ms(_percentile(m.ttft, 99))},
        "itl_ms": {"p50": _ms(itl.percentile(50)), "p99": _ms(itl.percentile(99)), "mean": _ms(itl.mean)},
        "queue_wait_ms": {"p50": _ms(m.queue_wait.percentile(50)), "p99": _ms(m.queue_wait.percentile(99))},
        "goodput": {
            "requests": m.good,
            "requests_per_s": round(m.good / seconds, 3),
            "share_of_completed": round(m.good / m.completed, 4) if m.completed else None,
            "share_of_arrived": round(m.good / m.arrived, 4) if m.arrived else None,
            "output_tokens_per_s": round(m.good_tokens / seconds, 1),
        },
        "prefix_hit_rate": round(m.cached_tokens / m.prompt_tokens, 4) if m.prompt_tokens else None,
        "prompt_tokens": m.prompt_tokens,
        "output_tokens": m.output_tokens,
        "preemptions": m.preemptions,
    }


def build_report(fleet: Fleet, wall_s: float) -> dict:
    s, metrics = fleet.setup, fleet.metrics
    seconds = max(s.duration_s - s.warmup_s, 1e-9)
    tiers = {name: tier_report(m, seconds) for name, m in sorted(metrics.tiers.items())}
    prompt = sum(m.prompt_tokens for m in metrics.tiers.values())
    cached = sum(m.cached_tokens for m in metrics.tiers.values())
    arrived = sum(m.arrived for m in metrics.tiers.values())
    ended = sum(m.completed + m.cancelled for m in metrics.tiers.values())
    everyone = fleet.all_replicas  # the autoscaler's removed replicas too
    replica_s = fleet.replica_seconds()
    replica_hours = replica_s / 3600
    if fleet.removed or fleet.joined_at:
        busy_share = sum(r.busy_s for r in everyone) / max(replica_s, 1e-9)
    else:
        busy_share = sum(r.busy_s for r in fleet.replicas) / max(fleet.clock.now, 1e-9) / len(fleet.replicas)
    return {
        "setup": {
            **s.describe,
            "replicas": len(fleet.replicas),
            "replicas_at_start": s.replicas,
            "replicas_peak": fleet.peak_replicas,
            "replicas_removed": len(fleet.removed),
            "policy": s.policy,
            "seed": s.seed,
            "duration_s": s.duration_s,
            "warmup_s": s.warmup_s,
            "kv_blocks_per_replica": s.spec.num_blocks,
        },
        "totals": {
            "requests_arrived": arrived,
            "requests_ended": ended,
            "unfinished_at_end": fleet.in_flight,
            "queued_at_end": fleet.gateway.queued,
            "output_tokens_per_s": round(sum(m.output_tokens for m in metrics.tiers.values()) / seconds, 1),
            "prefix_hit_rate": round(cached / prompt, 4) if prompt else None,
            "requests_refused": sum(m.shed + m.quota + m.length for m in metrics.tiers.values()),
            "requests_rejected": sum(m.rejected for m in metrics.tiers.values()),
            "preemptions": sum(r.scheduler.num_preemptions for r in everyone),
            "replica_hours": round(replica_hours, 4),
            "gpu_hours": round(replica_hours * s.gpus_per_replica, 4),
            "replica_busy_share": round(busy_share, 4),
            "overload_max_level": fleet.max_level,
            "overload_level_seconds": [round(x, 1) for x in fleet.level_seconds],
            "engine_steps": sum(r.steps for r in everyone),
            "full_steps": sum(r.full_steps for r in everyone),
        },
        "tiers": tiers,
        "wall_s": round(wall_s, 3),
        "requests_simulated": fleet.requests_seen,
        "requests_per_wall_minute": round(fleet.requests_seen / wall_s * 60) if wall_s else None,
    }


def scaling_report(scaled) -> dict:
    """What the autoscaler did (sim/autoscaling.ScaledFleet): its GPU-hours replace the fixed fleet's."""
    records = scaled.records
    return {
        "mode": scaled.settings.mode,
        "cold_start_s": scaled.scaling.cold_start_s,
        "gpu_hours": round(scaled.gpu_hours, 4),
        "events": dict(scaled.events),
        "decisions": len(records),
        "peak_replicas": max((r.ready + r.starting + r.draining for r in records), default=0),
        "replicas_at_end": len(scaled.fleet.replicas),
        "batch_allowed_share": round(sum(r.batch_allowed for r in records) / len(records), 4) if records else None,
    }


def disagg_report(fleet) -> dict:
    """The prefill and decode pools (sim/disagg.DisaggFleet): KV transfers between them."""
    return {
        "prefill_replicas": len(fleet.prefill),
        "decode_replicas": len(fleet.decode),
        "transfers": fleet.transfers,
        "recomputed": fleet.recomputed,
        "transfer_ms_mean": _ms(fleet.transfer_s_total / fleet.transfers) if fleet.transfers else None,
    }


def summary(report: dict) -> str:
    s, t = report["setup"], report["totals"]
    start, peak = s.get("replicas_at_start", s["replicas"]), s.get("replicas_peak", s["replicas"])
    if start == peak == s["replicas"] and not s.get("replicas_removed"):
        on = f"{s['replicas']} replicas"
    else:  # autoscaled: the count varied over the run
        on = f"up to {peak} replicas ({start} at the start, {s['replicas']} at the end)"
    lines = [
        f"{s.get('model', '?')} on {on} ({s.get('gpu', '?')}, "
        f"TP {s.get('tensor_parallel', '?')}, {s.get('weight_dtype', '?')}), routing {s['policy']}, "
        f"seed {s['seed']}, {s['duration_s']:g} s simulated",
        f"requests {t['requests_arrived']} arrived = {t['requests_ended']} ended + "
        f"{t.get('requests_refused', 0)} refused + {t.get('requests_rejected', 0)} rejected + "
        f"{t['unfinished_at_end']} running + {t['queued_at_end']} queued at the end; "
        f"{t['output_tokens_per_s']:.0f} output tokens/s; prefix hit rate {t['prefix_hit_rate']}; "
        f"preemptions {t['preemptions']}; {t['gpu_hours']:.2f} GPU-hours; "
        f"replicas busy {t['replica_busy_share']:.0%}; overload max level {t['overload_max_level']}",
        f"{'tier':<11}{'arrived':>8}{'done':>8}{'cancel':>7}{'shed':>6}{'quota':>6}{'length':>7}{'reject':>7}"
        f"{'delayed':>8}"
        f"{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>8}{'goodput':>9}{'hit':>6}",
    ]
    for name, r in report["tiers"].items():
        lines.append(
            f"{name:<11}{r['arrived']:>8}{r['completed']:>8}{r['cancelled']:>7}{r['shed']:>6}"
            f"{r['quota_refused']:>6}{r.get('length_refused', 0):>7}{r['rejected']:>7}{r['delayed']:>8}"
            f"{_fmt(r['ttft_ms']['p50']):>10}"
            f"{_fmt(r['ttft_ms']['p99']):>9}{_fmt(r['itl_ms']['p50']):>9}{_fmt(r['itl_ms']['p99']):>8}"
            f"{_pct(r['goodput']['share_of_completed']):>9}{_pct(r['prefix_hit_rate']):>6}"
        )
    if "autoscaling" in report:
        a = report["autoscaling"]
        lines.append(
            f"autoscaler ({a['mode']}, cold start {a['cold_start_s']:g} s): {a['events']}, peak "
            f"{a['peak_replicas']} replicas, {a['replicas_at_end']} at the end; batch allowed "
            f"{_pct(a['batch_allowed_share'])} of decisions"
        )
    if "disaggregated" in report:
        d = report["disaggregated"]
        lines.append(
            f"{d['prefill_replicas']} prefill + {d['decode_replicas']} decode replicas: {d['transfers']} "
            f"KV transfers (mean {_fmt(d['transfer_ms_mean'])} ms), {d['recomputed']} recomputed"
        )
    lines.append(
        f"(latencies in ms; length: refused, prompt + answer over max_model_len; reject: too long for the "
        f"KV cache; goodput: completed within the SLO, share of completed; wall time {report['wall_s']:.1f} s, "
        f"{report['requests_per_wall_minute']} simulated requests per wall minute)"
    )
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def write(report: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "summary.txt").write_text(summary(report) + "\n")
    return out
