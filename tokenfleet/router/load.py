"""Load reports the router places requests by: how much work a replica has in flight and how full its KV cache is.

Our replicas answer GET /load (JSON, see tokenfleet.replica.metrics.load_report); an external OpenAI-compatible
server (vLLM, SGLang) is read from its Prometheus GET /metrics. Every fetch is bounded by a timeout and fails with
LoadUnavailable, never hangs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenfleet.router.health import HealthTracker

log = logging.getLogger(__name__)

# report field -> metric names to try, first present wins (vLLM v1, older vLLM, SGLang)
PROMETHEUS_NAMES = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "prefill_tokens_total": ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total"),
}
HEALTH_REASONS = {"connect", "timeout", "5xx"}  # LoadUnavailable reasons that say something about the replica


@dataclass
class LoadReport:
    running: int  # sequences in the running batch
    waiting: int  # sequences queued (waiting or swapped out)
    queued_tokens: int  # prompt tokens not yet prefilled; 0 where the server does not tell
    kv_usage: float  # fraction of KV cache blocks in use, 0..1
    fetched_at: float  # time.monotonic() when it arrived
    prefill_tokens_total: int | None = None  # prompt tokens prefilled since the replica started; None: not told


class Upstream(Protocol):
    """How the gateway reaches one replica (gateway/upstream.py: in process or over HTTP)."""

    def stream(self, kind: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...

    async def load(self) -> LoadReport: ...


class LoadUnavailable(Exception):
    """No load report from a replica. `reason`: "connect" | "timeout" | "5xx" | "bad_response"."""

    def __init__(self, url: str, reason: str, detail: str) -> None:
        super().__init__(f"no load report from {url}: {reason} ({detail})")
        self.url, self.reason, self.detail = url, reason, detail


async def fetch_load(
    client: httpx.AsyncClient, base_url: str, kind: str = "tokenfleet", timeout_s: float = 1.0
) -> LoadReport:
    """kind "tokenfleet": GET /load of our replica; kind "openai": GET /metrics of a vLLM or SGLang server."""
    if kind not in PARSERS:
        raise ValueError(f"unknown replica kind {kind!r}; expected one of {sorted(PARSERS)}")
    path, parse = PARSERS[kind]
    url = base_url.rstrip("/") + path
    try:
        # wait_for bounds the whole exchange: httpx's timeout applies per read, so a trickling server could outlast it
        response = await asyncio.wait_for(client.get(url, timeout=timeout_s), timeout_s)
    except (TimeoutError, httpx.TimeoutException) as e:
        raise LoadUnavailable(url, "timeout", f"no answer within {timeout_s:g}s") from e
    except httpx.HTTPError as e:
        raise LoadUnavailable(url, "connect", f"{e.__class__.__name__}: {e}") from e
    if response.status_code != 200:
        reason = "5xx" if response.status_code >= 500 else "bad_response"
        raise LoadUnavailable(url, reason, f"answered {response.status_code}")
    try:
        return parse(response.text, time.monotonic())
    except (ValueError, KeyError, TypeError) as e:
        raise LoadUnavailable(url, "bad_response", f"{e.__class__.__name__}: {e}") from e


def parse_load_json(text: str, fetched_at: float) -> LoadReport:
    """Our replica's GET /load body."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    return load_report_from(data, fetched_at)


def load_report_from(data: dict[str, Any], fetched_at: float) -> LoadReport:
    """Our replica's load report, as GET /load answers it (or the in-process replica hands it over)."""
    return LoadReport(
        running=int(data["running"]),
        waiting=int(data["waiting"]) + int(data.get("swapped", 0)),
        queued_tokens=int(data["queued_prefill_tokens"]),
        kv_usage=float(data["kv_usage"]),
        fetched_at=fetched_at,
        prefill_tokens_total=int(data["prefill_tokens_total"]) if "prefill_tokens_total" in data else None,
    )


def parse_prometheus(text: str, fetched_at: float) -> LoadReport:
    """A vLLM / SGLang GET /metrics body. Counts are summed over label sets (several engines behind one server);
    the KV usage fraction is their mean."""
    wanted = {name for names in PROMETHEUS_NAMES.values() for name in names}
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and sample.value == sample.value:  # skips NaN
                values.setdefault(sample.name, []).append(sample.value)

    def pick(field: str) -> list[float]:
        for name in PROMETHEUS_NAMES[field]:
            if values.get(name):
                return values[name]
        raise KeyError(f"none of {', '.join(PROMETHEUS_NAMES[field])} in the metrics")

    running, waiting, kv = pick("running"), pick("waiting"), pick("kv_usage")
    try:
        prefilled: int | None = round(sum(pick("prefill_tokens_total")))
    except KeyError:  # an older server: the gateway's configured prefill rate stands in
        prefilled = None
    return LoadReport(
        running=round(sum(running)),
        waiting=round(sum(waiting)),
        queued_tokens=0,
        kv_usage=sum(kv) / len(kv),
        fetched_at=fetched_at,
        prefill_tokens_total=prefilled,
    )


PARSERS: dict[str, tuple[str, Callable[[str, float], LoadReport]]] = {
    "tokenfleet": ("/load", parse_load_json),
    "openai": ("/metrics", parse_prometheus),
}


@dataclass
class PollTarget:
    base_url: str
    kind: str = "tokenfleet"


class LoadPoller:
    """Keeps the latest good load report of each replica, refreshed every interval_s. A failed fetch keeps the
    previous report (its age tells how stale it is), is remembered in `errors`, and is reported to `health`."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        health: HealthTracker | None = None,
    ) -> None:
        self.client, self.interval_s, self.timeout_s, self.health = client, interval_s, timeout_s, health
        self.targets: dict[str, PollTarget] = {}
        self.reports: dict[str, LoadReport] = {}  # last good report per replica
        self.errors: dict[str, LoadUnavailable] = {}  # last poll's error, for replicas whose last poll failed

    def add(self, name: str, base_url: str, kind: str = "tokenfleet") -> None:
        if kind not in PARSERS:
            raise ValueError(f"unknown replica kind {kind!r}; expected one of {sorted(PARSERS)}")
        self.targets[name] = PollTarget(base_url, kind)

    def remove(self, name: str) -> None:
        for table in (self.targets, self.reports, self.errors):
            table.pop(name, None)

    def report(self, name: str, max_age_s: float | None = None) -> LoadReport | None:
        """The last good report, or None if there is none (or it is older than max_age_s)."""
        report = self.reports.get(name)
        if report is None or (max_age_s is not None and time.monotonic() - report.fetched_at > max_age_s):
            return None
        return report

    def age(self, name: str) -> float | None:
        report = self.reports.get(name)
        return None if report is None else time.monotonic() - report.fetched_at

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(name, target) for name, target in list(self.targets.items())))

    async def run(self) -> None:
        """Polls every interval_s until cancelled."""
        while True:
            started = time.monotonic()
            try:
                await self.poll_once()
            except Exception:  # a bug here must not silently stop load reports for the whole fleet
                log.exception("load poll failed")
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def snapshot(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, target in self.targets.items():
            report, error = self.reports.get(name), self.errors.get(name)
            out[name] = {
                "base_url": target.base_url,
                "kind": target.kind,
                "report": None
                if report is None
                else {
                    "running": report.running,
                    "waiting": report.waiting,
                    "queued_tokens": report.queued_tokens,
                    "kv_usage": report.kv_usage,
                },
                "age_s": self.age(name),
                "error": None if error is None else str(error),
            }
        return out

    async def _poll(self, name: str, target: PollTarget) -> None:
        try:
            report = await fetch_load(self.client, target.base_url, target.kind, self.timeout_s)
        except LoadUnavailable as e:
            if self.targets.get(name) is not target:
                return  # removed or re-pointed while we waited
            if name not in self.errors:
                log.warning("replica %s: %s", name, e)
            self.errors[name] = e
            if self.health is not None and e.reason in HEALTH_REASONS:
                self.health.record_failure(name, e.reason, f"GET load: {e.detail}")
            return
        if self.targets.get(name) is target:
            self.reports[name] = report
            self.errors.pop(name, None)
