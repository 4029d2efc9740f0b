"""Plots of the simulator experiments (bench/sim_experiments.py), as PNGs next to their reports in
docs/benchmarks/. matplotlib with the Agg backend (no display); `pip install -e ".[bench]"` brings it."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TIER_COLOURS = {"enterprise": "tab:purple", "paid": "tab:blue", "free": "tab:orange", "batch": "tab:gray"}
INTERACTIVE = ("enterprise", "paid", "free")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def capacity(result: dict, path: Path, ttft_p99_s: float, itl_p99_s: float) -> Path:
    rows = result["rows"]
    rates = [r["per_node_rps"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.semilogy(rates, [r["ttft_p99_ms"] / 1000 for r in rows], "o-", label="worst TTFT p99")
    a.axhline(ttft_p99_s, color="red", ls="--", label=f"target {ttft_p99_s:g} s")
    a.set(xlabel="requests/s per node", ylabel="seconds", title="TTFT p99 (worst interactive tier)")
    a.legend()
    b.plot(rates, [r["itl_p99_ms"] for r in rows], "o-", label="worst ITL p99")
    b.axhline(itl_p99_s * 1000, color="red", ls="--", label=f"target {itl_p99_s * 1000:g} ms")
    b.set(xlabel="requests/s per node", ylabel="ms", title="Inter-token latency p99")
    b2 = b.twinx()
    b2.bar(rates, [r["preemptions"] for r in rows], width=1.5, alpha=0.25, color="tab:red")
    b2.set_ylabel("preemptions (bars)")
    b.legend(loc="upper left")
    return _save(fig, path)


def routing(result: dict, path: Path) -> Path:
    rows = result["rows"]
    names = [r["policy"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for ax, key, title in zip(
        axes,
        ("prefix_hit_rate", "ttft_p50_ms", "itl_p99_ms"),
        ("prefix hit rate", "paid TTFT p50 (ms)", "worst ITL p99 (ms)"),
    ):
        ax.bar(names, [r[key] for r in rows], color=["tab:gray", "tab:olive", "tab:green"])
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=15)
    return _save(fig, path)


def _tier_series(rows: list[dict], tier: str, key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        value = row["tiers"].get(tier, {}).get(key)
        if value is not None:
            xs.append(row["t"])
            ys.append(value)
    return xs, ys


def overload(runs: dict[str, dict], path: Path) -> Path:
    """runs: name -> {"bins": TimelineMetrics.rows(), "samples": gauges}; the first is the ladder's."""
    name, run = next(iter(runs.items()))
    bins, samples = run["bins"], run["samples"]
    bin_s = bins[1]["t"] - bins[0]["t"] if len(bins) > 1 else 1.0
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    arrivals = [sum(t["arrived"] for t in row["tiers"].values()) / bin_s for row in bins]
    a.plot([row["t"] for row in bins], arrivals, color="black", label="arrivals (req/s)")
    a.set_ylabel("requests/s")
    a2 = a.twinx()
    a2.step(
        [s["t"] for s in samples], [s["level"] for s in samples], where="post", color="tab:red", label="ladder level"
    )
    a2.set(ylabel="ladder level", ylim=(-0.2, 4.5))
    a.set_title(f"launch-day spike: arrivals and the overload ladder ({name})")
    a.legend(loc="upper left"), a2.legend(loc="upper right")
    for tier in TIER_COLOURS:
        xs, ys = _tier_series(bins, tier, "ttft_p99_s")
        b.semilogy(xs, ys, label=f"{tier}, ladder", color=TIER_COLOURS[tier])
    for other, orun in list(runs.items())[1:]:
        for tier in ("paid", "enterprise"):
            xs, ys = _tier_series(orun["bins"], tier, "ttft_p99_s")
            b.semilogy(xs, ys, ls=":", color=TIER_COLOURS[tier], label=f"{tier}, {other}")
    b.set(ylabel="TTFT p99 (s), by arrival", title="TTFT p99 per tier")
    b.legend(fontsize=7, ncol=2)
    for tier in TIER_COLOURS:
        xs, shed = _tier_series(bins, tier, "shed")
        _, delayed = _tier_series(bins, tier, "delayed")
        c.plot(xs, [v / bin_s for v in shed], color=TIER_COLOURS[tier], label=f"{tier} shed")
        c.plot(xs, [v / bin_s for v in delayed], color=TIER_COLOURS[tier], ls="--", label=f"{tier} delayed")
    c.set(xlabel="simulated seconds", ylabel="requests/s", title="shed (429) and delayed in the fair queue")
    c.legend(fontsize=7, ncol=4)
    return _save(fig, path)


def autoscale(runs: dict[str, dict], path: Path) -> Path:
    """runs: mode -> {"records": ScalingRecord dicts, "bins": TimelineMetrics.rows()}."""
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    styles = {"forecast": "tab:green", "reactive": "tab:red", "static": "tab:gray"}
    first = next(iter(runs.values()))
    a.plot(
        [r["t"] for r in first["records"]],
        [r["arrival_rate"] for r in first["records"]],
        color="black",
        label="interactive arrivals (req/s, measured)",
    )
    if any(r["forecast_rps"] is not None for r in first["records"]):
        a.plot(
            [r["t"] for r in first["records"]],
            [r["forecast_rps"] for r in first["records"]],
            color="tab:blue",
            ls="--",
            label="forecast peak a cold start ahead",
        )
    a.set(ylabel="requests/s", title="load over the (compressed) day")
    a.legend(fontsize=8)
    for mode, run in runs.items():
        recs = run["records"]
        b.step(
            [r["t"] for r in recs],
            [r["ready"] for r in recs],
            where="post",
            color=styles.get(mode),
            label=f"{mode}: serving",
        )
        b.step(
            [r["t"] for r in recs],
            [r["ready"] + r["starting"] for r in recs],
            where="post",
            color=styles.get(mode),
            ls=":",
            label=f"{mode}: + starting",
        )
        xs = [row["t"] for row in run["bins"]]
        missed = [
            sum(row["tiers"].get(t, {}).get("missed", 0) + row["tiers"].get(t, {}).get("shed", 0) for t in INTERACTIVE)
            for row in run["bins"]
        ]
        c.plot(xs, missed, color=styles.get(mode), label=mode)
    b.set(ylabel="replicas (1 GPU each)", title="replicas")
    b.legend(fontsize=8, ncol=3)
    c.set(xlabel="simulated seconds", ylabel="requests per bin", title="interactive requests outside the SLO or shed")
    c.legend(fontsize=8)
    return _save(fig, path)


def disagg(result: dict, path: Path) -> Path:
    """Goodput per GPU against offered load, one panel per workload and SLO, a line per layout."""
    rows, spec = result["rows"], result["spec"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    columns = max(len(spec["workloads"][w].get("slos") or spec["slos"]) for w in workloads)
    fig, axes = plt.subplots(len(workloads), columns, figsize=(5 * columns, 3.6 * len(workloads)), squeeze=False)
    for i, workload in enumerate(workloads):
        for j, slo in enumerate(spec["workloads"][workload].get("slos") or spec["slos"]):
            ax = axes[i][j]
            for layout in dict.fromkeys(r["layout"] for r in rows):
                mine = [r for r in rows if r["workload"] == workload and r["layout"] == layout]
                ax.plot(
                    [r["per_gpu_rps"] for r in mine], [r[f"goodput_{slo['name']}"] for r in mine], "o-", label=layout
                )
            ax.set(
                xlabel="offered requests/s per GPU",
                ylabel="goodput (req/s per GPU)",
                title=f"{workload}: {slo['name']} (TTFT <= {slo['ttft_s']:g} s, TPOT <= {slo['tpot_s'] * 1000:g} ms)",
            )
            ax.title.set_fontsize(9)
            ax.legend(fontsize=7)
    return _save(fig, path)
