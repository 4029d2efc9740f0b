"""Replica metrics under vLLM's Prometheus names, so existing dashboards, autoscalers and routers work unchanged,
and the /load report the router reads."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenfleet.engine.outputs import RequestTiming
from tokenfleet.engine.state import EngineState, SpecDecodeStats, load_report  # noqa: F401  (load_report: /load)

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)


class ReplicaMetrics:
    def __init__(self, state: Callable[[], EngineState], model_name: str) -> None:
        """state: the engine's latest EngineState (AsyncEngine.state or EngineProcess.state)."""
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.labels = {"model_name": model_name}

        def gauge(name: str, doc: str, fn) -> None:
            Gauge(name, doc, labels, registry=self.registry).labels(**self.labels).set_function(fn)

        gauge("vllm:num_requests_running", "Requests in the running batch.", lambda: state().load["running"])
        gauge(
            "vllm:num_requests_waiting",
            "Requests waiting or swapped out.",
            lambda: (load := state().load)["waiting"] + load["swapped"],
        )
        gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", lambda: state().load["kv_usage"])
        gauge(
            "tokenfleet:kv_cache_tokens",
            "Tokens the KV cache holds (blocks x block size).",
            lambda: state().load["kv_cache_tokens"],
        )
        self.registry.register(_SchedulerCounters(state, model_name))
        histogram = dict(labelnames=labels, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", **histogram)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", **histogram)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", **histogram)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Time in the engine's waiting queue, until first scheduled.", **histogram
        )
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds", "Time from first scheduled to the first token.", **histogram
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=self.registry)
        self.finished = Counter(
            "vllm:request_success",
            "Requests finished, by reason.",
            labels + ["finished_reason"],
            registry=self.registry,
        )

    def observe_request(
        self,
        arrival: float,
        first_token: float | None,
        finish: float,
        gaps: list[float],
        prompt_tokens: int,
        output_tokens: int,
        reason: str | None,
    ) -> None:
        self.e2e.labels(**self.labels).observe(finish - arrival)
        if first_token is not None:
            self.ttft.labels(**self.labels).observe(first_token - arrival)
        itl = self.itl.labels(**self.labels)
        for gap in gaps:
            itl.observe(gap)
        self.prompt_tokens.labels(**self.labels).inc(prompt_tokens)
        self.generation_tokens.labels(**self.labels).inc(output_tokens)
        self.finished.labels(**self.labels, finished_reason=reason or "unknown").inc()

    def observe_engine_wait(self, timing: RequestTiming | None, first_token: float | None) -> None:
        """Where the time to first token went inside the engine: its waiting queue, then its prefill."""
        if timing is None or timing.scheduled_time is None:
            return
        self.queue_time.labels(**self.labels).observe(max(0.0, timing.scheduled_time - timing.arrival_time))
        if first_token is not None:
            self.prefill_time.labels(**self.labels).observe(max(0.0, first_token - timing.scheduled_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCounters:
    """Counters the scheduler keeps, read at scrape time (exposed as vLLM's *_total counters)."""

    def __init__(self, state: Callable[[], EngineState], model_name: str) -> None:
        self.state, self.model_name = state, model_name

    def collect(self):
        state = self.state()
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", state.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", state.prefix_cache_hits),
            ("vllm:num_preemptions", "Preemptions.", state.num_preemptions),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        yield self._step_time(state)
        if state.spec_decode is not None:
            yield from self._spec_decode(state.spec_decode)

    def _spec_decode(self, spec: SpecDecodeStats) -> Iterator[Metric]:
        """Speculative decoding under vLLM's names: its v1 counters, and the v0 acceptance-rate gauge; the mean
        accepted length (1 + accepted / drafts, as vLLM's logs give it) under ours."""
        labels = [self.model_name]
        for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Verifications of at least one proposal.", spec.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified.", spec.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", spec.num_accepted_tokens),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by position in the proposal.",
            labels=["model_name", "position"],
        )
        for position, value in enumerate(spec.accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], value)
        yield per_position
        for name, doc, ratio in (
            (
                "vllm:spec_decode_draft_acceptance_rate",
                "Accepted proposed tokens / proposed tokens verified.",
                spec.acceptance_rate,
            ),
            (
                "tokenfleet:spec_decode_mean_accepted_length",
                "Tokens per verification: 1 + accepted proposals per verification.",
                spec.mean_accepted_length,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(labels, ratio)
            yield gauge

    def _step_time(self, state: EngineState) -> CounterMetricFamily:
        """Where engine step time goes, so served-mode overheads show up next to the offline profile."""
        stats = state.stats
        family = CounterMetricFamily(
            "tokenfleet:engine_step_seconds", "Engine step time by phase.", labels=["model_name", "phase"]
        )
        for phase in ("schedule", "prepare", "forward", "sample", "output"):
            family.add_metric([self.model_name, phase], getattr(stats, f"{phase}_s"))
        return family
