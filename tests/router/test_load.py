"""Load reports over real HTTP: our replica's /load, vLLM / SGLang Prometheus text, failures that must not hang,
and the poller that keeps the last good report per replica."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest

from tests.router.test_health import FakeReplica
from tests.servers import free_port
from tokenfleet.engine.request import RequestStatus
from tokenfleet.replica.metrics import load_report
from tokenfleet.router.health import HealthSettings, HealthTracker
from tokenfleet.router.load import LoadPoller, LoadUnavailable, fetch_load, parse_prometheus

MODEL = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'

# what a vLLM v1 server with two data-parallel engines answers on /metrics (trimmed)
VLLM_V1_METRICS = f"""\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 12873.0
python_gc_objects_collected_total{{generation="1"}} 1688.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.147483648e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{MODEL}}} 12.0
vllm:num_requests_running{{engine="1",{MODEL}}} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{MODEL}}} 3.0
vllm:num_requests_waiting{{engine="1",{MODEL}}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{MODEL}}} 0.8125
vllm:kv_cache_usage_perc{{engine="1",{MODEL}}} 0.4375
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",{MODEL}}} 1.254e+06
vllm:prefix_cache_queries_total{{engine="1",{MODEL}}} 1.198e+06
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",{MODEL}}} 4.0
vllm:num_preemptions_total{{engine="1",{MODEL}}} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{{engine="0",{MODEL}}} 341.27
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.04",{MODEL}}} 310.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",{MODEL}}} 1450.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",{MODEL}}} 1873.0
vllm:time_to_first_token_seconds_count{{engine="0",{MODEL}}} 1873.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0"}} 1.0
"""

# an older (V0) vLLM: no engine label, the KV gauge under its old name, swapped requests separately
VLLM_V0_METRICS = f"""\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{MODEL}}} 7.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{{{MODEL}}} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{MODEL}}} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{{MODEL}}} 0.42
"""

SGLANG_METRICS = f"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{MODEL}}} 25.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{{MODEL}}} 4.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{{{MODEL}}} 0.28
"""


def replica_load() -> dict:
    """The real replica's load_report over a stand-in engine: 2 running (one still prefilling 300 tokens),
    1 waiting with a 500-token prompt, 1 swapped out with 40 tokens to recompute."""

    def request(status: RequestStatus, uncomputed: int) -> SimpleNamespace:
        return SimpleNamespace(status=status, num_uncomputed_tokens=uncomputed)

    engine = SimpleNamespace(
        scheduler=SimpleNamespace(
            running=[request(RequestStatus.RUNNING, 1), request(RequestStatus.RUNNING, 300)],
            queue=[request(RequestStatus.WAITING, 500), request(RequestStatus.SWAPPED, 40)],
            num_prefill_tokens=7000,
        ),
        blocks=SimpleNamespace(usage=lambda: 0.625, num_blocks=4096, block_size=16),
    )
    return load_report(engine)


def fetch(url: str, kind: str = "tokenfleet", timeout_s: float = 1.0):
    async def go():
        async with httpx.AsyncClient() as client:
            return await fetch_load(client, url, kind, timeout_s)

    return asyncio.run(go())


def unavailable(url: str, kind: str = "tokenfleet", timeout_s: float = 1.0) -> tuple[LoadUnavailable, float]:
    started = time.monotonic()
    with pytest.raises(LoadUnavailable) as info:
        fetch(url, kind, timeout_s)
    return info.value, time.monotonic() - started


# --- fetch_load -------------------------------------------------------------------------------------------------


def test_reads_our_replicas_load_report():
    with FakeReplica(load=replica_load()) as replica:
        before = time.monotonic()
        report = fetch(replica.url)
    assert (report.running, report.waiting, report.queued_tokens) == (2, 2, 840)
    assert report.kv_usage == 0.625 and report.prefill_tokens_total == 7000
    assert before <= report.fetched_at <= time.monotonic()


def test_reads_vllm_prometheus_metrics_summing_over_engines():
    with FakeReplica(metrics_text=VLLM_V1_METRICS) as replica:
        report = fetch(replica.url + "/", kind="openai")
    assert (report.running, report.waiting, report.queued_tokens) == (21, 3, 0)
    assert report.kv_usage == pytest.approx(0.625)  # the engines' mean: a fraction does not add up


def test_reads_older_vllm_and_sglang_metric_names():
    old = parse_prometheus(VLLM_V0_METRICS, fetched_at=1.0)
    assert (old.running, old.waiting, old.kv_usage) == (7, 2, pytest.approx(0.42))
    sglang = parse_prometheus(SGLANG_METRICS, fetched_at=1.0)
    assert (sglang.running, sglang.waiting, sglang.kv_usage) == (25, 4, pytest.approx(0.28))


def test_errors_are_load_unavailable_with_a_reason():
    with FakeReplica(load={"running": 1}, metrics_text="# TYPE up gauge\nup 1\n") as replica:
        missing_field, _ = unavailable(replica.url)
        not_vllm, _ = unavailable(replica.url, kind="openai")
        replica.metrics_text = "this is { not prometheus"
        garbage, _ = unavailable(replica.url, kind="openai")
        replica.modes["/load"] = "500"
        server_error, _ = unavailable(replica.url)
    assert missing_field.reason == not_vllm.reason == garbage.reason == "bad_response"
    assert "vllm:num_requests_running" in str(not_vllm)
    assert server_error.reason == "5xx" and "answered 500" in str(server_error)
    with pytest.raises(ValueError):
        fetch("http://127.0.0.1:1", kind="triton")


def test_a_hanging_endpoint_times_out():
    with FakeReplica() as replica:
        replica.modes["/metrics"] = "hang"
        error, elapsed = unavailable(replica.url, kind="openai", timeout_s=0.3)
    assert error.reason == "timeout"
    assert elapsed < 1.0


def test_a_refused_connection_fails_fast():
    error, elapsed = unavailable(f"http://127.0.0.1:{free_port()}", timeout_s=5.0)
    assert error.reason == "connect"
    assert elapsed < 1.0


# --- LoadPoller -------------------------------------------------------------------------------------------------


def test_poller_keeps_the_last_good_report_and_tells_health_about_failures():
    health = HealthTracker(HealthSettings(consecutive_failures=2))
    dead_url = f"http://127.0.0.1:{free_port()}"

    async def scenario(good: FakeReplica, stuck: FakeReplica) -> None:
        async with httpx.AsyncClient() as client:
            poller = LoadPoller(client, interval_s=0.05, timeout_s=0.3, health=health)
            for name, url in (("good", good.url), ("dead", dead_url), ("stuck", stuck.url)):
                poller.add(name, url)
                health.add(name, url)
            health.add("spare", None)
            started = time.monotonic()
            await poller.poll_once()
            assert time.monotonic() - started < 1.0  # the hanging replica holds nobody up past the timeout
            await poller.poll_once()
            first = poller.report("good")
            assert first is not None and first.running == 2
            assert poller.report("dead") is None and poller.errors["dead"].reason == "connect"
            assert poller.errors["stuck"].reason == "timeout"
            assert health.state("dead") == "open"  # two failed polls in a row
            assert health.state("stuck") == "open"

            good.modes["/load"] = "500"
            await poller.poll_once()
            assert poller.report("good") is first  # still the last good one, getting older
            assert poller.errors["good"].reason == "5xx"
            assert poller.age("good") > 0 and poller.report("good", max_age_s=0.0) is None
            assert poller.snapshot()["good"]["error"].startswith("no load report")

            good.modes["/load"] = "ok"
            task = asyncio.create_task(poller.run())
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert poller.report("good").fetched_at > first.fetched_at and "good" not in poller.errors
            poller.remove("dead")
            assert "dead" not in poller.snapshot() and poller.age("dead") is None

    with FakeReplica(load=replica_load()) as good, FakeReplica() as stuck:
        stuck.modes["/load"] = "hang"
        asyncio.run(scenario(good, stuck))
