"""Chunked prefill on every replica against separate prefill and decode pools (tokenfleet/sim/disagg.py), at equal
GPU count: goodput (requests/s per GPU completed within both a TTFT and a time-per-output-token target) under
several SLOs, for a multi-turn chat workload and a long-document one. Part of bench/sim_experiments.py."""

from __future__ import annotations

import copy
import sys
import time

from tokenfleet.sim import config
from tokenfleet.sim.fleet import Fleet
from tokenfleet.sim.metrics import Metrics
from tokenfleet.sim.report import build_report
from tokenfleet.sim.timeline import percentile


class RequestLog(Metrics):
    """The run's metrics, plus (TTFT, mean time per output token) of every completed request."""

    def __init__(self, slo, since: float) -> None:
        super().__init__(slo, since)
        self.done: list[tuple[float, float]] = []

    def ended(self, sreq) -> None:
        super().ended(sreq)
        if self.counts(sreq) and sreq.status == "ok" and sreq.first_token is not None:
            tpot = (sreq.finished - sreq.first_token) / (sreq.tokens_out - 1) if sreq.tokens_out > 1 else 0.0
            self.done.append((sreq.first_token - sreq.arrival, tpot))


def build(raw: dict, layout: str, spec: dict) -> Fleet:
    raw = copy.deepcopy(raw)
    gpus = raw["fleet"]["replicas"] * raw["fleet"].get("tensor_parallel", 1)
    if layout.startswith("chunked"):
        if "-" in layout:
            raw.setdefault("engine", {})["max_num_batched_tokens"] = int(layout.split("-")[1])
        return Fleet(config.parse(raw))
    prefill, decode = (int(x) for x in layout.split("+"))
    if (prefill + decode) * raw["fleet"].get("tensor_parallel", 1) != gpus:
        raise ValueError(f"layout {layout} does not use the {gpus} GPUs of the chunked fleet")
    link = ("link_gb_per_s", "link_efficiency", "transfer_latency_s", "prefill_batched_tokens")
    raw["disagg"] = {"prefill_replicas": prefill, "decode_replicas": decode, **{k: spec[k] for k in link if k in spec}}
    return config.parse_simulation(raw).fleet()


def one_run(raw: dict, layout: str, spec: dict, slos: list[dict]) -> dict:
    started = time.process_time()
    fleet = build(raw, layout, spec)
    fleet.metrics = log = RequestLog(fleet.setup.slo, fleet.setup.warmup_s)
    fleet.run()
    report = build_report(fleet, time.process_time() - started)
    gpus = sum(1 for _ in fleet.replicas) * fleet.setup.gpus_per_replica
    seconds = fleet.setup.duration_s - fleet.setup.warmup_s
    itl = [t["itl_ms"]["p99"] for t in report["tiers"].values() if t["itl_ms"]["p99"] is not None]
    row = {
        "layout": layout,
        "gpus": gpus,
        "completed": len(log.done),
        "ttft_p50_s": percentile([d[0] for d in log.done], 50),
        "ttft_p99_s": percentile([d[0] for d in log.done], 99),
        "tpot_p50_ms": _ms(percentile([d[1] for d in log.done], 50)),
        "tpot_p99_ms": _ms(percentile([d[1] for d in log.done], 99)),
        "itl_p99_ms": max(itl, default=None),
        "prefix_hit_rate": report["totals"]["prefix_hit_rate"],
        "unfinished": fleet.in_flight,
        "transfer_ms_mean": _transfer_ms(fleet),
        "recomputed": getattr(fleet, "recomputed", None),
        "cpu_s": round(time.process_time() - started, 1),
    }
    for slo in slos:
        good = sum(1 for ttft, tpot in log.done if ttft <= slo["ttft_s"] and tpot <= slo["tpot_s"])
        row[f"goodput_{slo['name']}"] = round(good / seconds / gpus, 4)
        row[f"share_{slo['name']}"] = round(good / max(len(log.done), 1), 4)
    return row


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _transfer_ms(fleet) -> float | None:
    transfers = getattr(fleet, "transfers", 0)
    return round(fleet.transfer_s_total / transfers * 1000, 3) if transfers else None


def experiment(base: dict, args) -> dict:
    base = copy.deepcopy(base)
    spec = base.pop("experiment")
    gpus = base["fleet"]["replicas"] * base["fleet"].get("tensor_parallel", 1)
    rows = []
    for name, work in spec["workloads"].items():
        loads = [float(x) for x in args.loads.split(",")] if args.loads else work["loads"]
        for load in loads:
            raw = copy.deepcopy(base)
            raw["workload"] = {**raw.get("workload", {}), **work.get("workload", {}), "rate": load * gpus}
            for layout in spec["layouts"]:
                rows.append({"workload": name, "per_gpu_rps": load, **one_run(raw, layout, spec, slos_of(spec, name))})
                print(rows[-1], file=sys.stderr)
    return {"rows": rows, "spec": spec}


def slos_of(spec: dict, workload: str) -> list[dict]:
    return spec["workloads"][workload].get("slos") or spec["slos"]


def _goodput(row: dict, slo: str) -> str:
    return f"{row['goodput_' + slo]:.2f} ({row['share_' + slo]:.0%})"


def render(result: dict, args, head: list[str]) -> str:
    spec = result["spec"]
    lines = list(head) + [
        f"KV transfer: {spec['transfer_latency_s'] * 1000:g} ms + prompt tokens x KV bytes per token / "
        f"({spec['link_gb_per_s']:g} GB/s x {spec['link_efficiency']:g}) into each decode replica, one at a time; "
        f"prefill pool token budget {spec.get('prefill_batched_tokens')} per step.",
        "",
    ]
    for workload in dict.fromkeys(r["workload"] for r in result["rows"]):
        slos = slos_of(spec, workload)
        lines += [
            f"## {workload}",
            "",
            "SLOs: "
            + "; ".join(
                f"**{s['name']}** TTFT <= {s['ttft_s']:g} s and time per output token <= {s['tpot_s'] * 1000:g} ms"
                for s in slos
            )
            + ".",
            "",
            "| req/s per GPU | layout | "
            + " | ".join(f"goodput {s['name']} (req/s/GPU)" for s in slos)
            + " | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | "
            "ITL p99 (ms) | prefix hits | KV transfer (ms) |",
            "|---:|---|" + "---:|" * (len(slos) + 5),
        ]
        for r in (r for r in result["rows"] if r["workload"] == workload):
            goods = " | ".join(_goodput(r, s["name"]) for s in slos)
            lines.append(
                f"| {r['per_gpu_rps']:g} | {r['layout']} | {goods} | {r['ttft_p50_s']:.2f} / "
                f"{r['ttft_p99_s']:.2f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | "
                f"{r['itl_p99_ms']:.0f} | {r['prefix_hit_rate']:.0%} | "
                f"{'-' if r['transfer_ms_mean'] is None else r['transfer_ms_mean']} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"
