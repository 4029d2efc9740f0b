"""The simulator's levers read the engine's measurements (docs/benchmarks/speculative.json, kv_capacity.json), and
what it predicts from them is checked against the measured numbers: the inter-token latency gained by n-gram
speculation, the tokens an FP8 KV cache holds, and how many sequences the engine admitted at once."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml

from tests.sim.helpers import Collect
from tokenfleet.engine.kv_blocks import prefix_block_hashes
from tokenfleet.engine.scheduler import SchedulerConfig
from tokenfleet.sim import config
from tokenfleet.sim.cost_model import CostModel, SpeculativeCostModel, StepBatch, StepCoefficients
from tokenfleet.sim.events import EventQueue, SimClock
from tokenfleet.sim.levers import MEASUREMENTS, Speculation, measured_kv_capacity, measured_speculation
from tokenfleet.sim.replica import ReplicaSpec, SimReplica
from tokenfleet.sim.request import SimRequest

ROOT = Path(__file__).resolve().parents[2]
SPECULATIVE = json.loads((MEASUREMENTS / "speculative.json").read_text())
KV_CAPACITY = json.loads((MEASUREMENTS / "kv_capacity.json").read_text())
STEPS_TOLERANCE = 0.03  # the requests' accepted lengths vary around the measured mean
PLAIN_ITL_TOLERANCE = 0.2  # a least-squares fit over all the steps, prefills included, on a shared machine


def tiny(**extra) -> dict:
    raw = yaml.safe_load((ROOT / "bench/sim/tiny.yaml").read_text())
    return {**raw, **extra}


def ours(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("engine", "tokenfleet") == "tokenfleet"]


def test_without_levers_nothing_changes():
    setup = config.parse(tiny())
    assert type(setup.cost) is CostModel
    assert "speculation" not in setup.describe and "kv_bytes_per_token_measured" not in setup.describe
    assert "_kv_token_bytes" not in setup.describe
    assert setup.kv_bytes_per_token == config.model_shape("llama-8b").kv_bytes_per_token("fp16")


def test_speculation_reads_the_measured_mean_accepted_length():
    setup = config.parse(tiny(levers={"speculative": "ngram"}))
    runs = [run for r in ours(SPECULATIVE["rows"]) if r["method"].startswith("ngram") for run in r["runs"]]
    assert isinstance(setup.cost, SpeculativeCostModel)
    assert setup.cost.k == SPECULATIVE["args"]["k"]
    assert setup.cost.accepted == statistics.median(run["mean_accepted_length"] for run in runs)
    assert "speculative.json (ngram)" in setup.describe["speculation"]


def bench_contexts() -> range:
    """The tokens before each decoded token of a bench/speculative.py request."""
    a = SPECULATIVE["args"]
    prompt = 1 + a["passage"] + a["quote_start"]
    return range(prompt, prompt + a["max_tokens"] - 1)


def mean_decode_time(cost: CostModel, batch: int) -> float:
    contexts = bench_contexts()
    return sum(cost.decode_time(batch, batch * (c + 1)) for c in contexts) / len(contexts)


def test_predicted_verifying_steps_are_the_engines():
    """A verifying step yields the measured mean accepted length of tokens: at batch 1, a request of max_tokens
    takes one prefill step and (max_tokens - 1) / L verifying steps, which is how many steps the engine took."""
    measured = measured_speculation(MEASUREMENTS, "ngram").speculation
    a = SPECULATIVE["args"]
    predicted = a["requests"] * (1 + (a["max_tokens"] - 1) / measured.mean_accepted_length)
    rows = [r for r in ours(SPECULATIVE["rows"]) if r["method"].startswith("ngram") and r["batch"] == 1]
    assert rows
    for run in rows[0]["runs"]:
        assert run["steps"] == pytest.approx(predicted, rel=STEPS_TOLERANCE)


def test_fitted_cost_model_gives_the_measured_itl_without_speculation():
    """bench/speculative.py fits the cost model on its steps without speculation: it reproduces their ITL."""
    plain = CostModel(StepCoefficients(**SPECULATIVE["plain_step_fit"]["coefficients"]))
    for row in ours(SPECULATIVE["rows"]):
        if row["method"] == "none":
            measured = statistics.median(run["itl_ms"] for run in row["runs"]) / 1000
            assert mean_decode_time(plain, row["batch"]) == pytest.approx(measured, rel=PLAIN_ITL_TOLERANCE)


def test_predicted_itl_speedup_bounds_the_measured_one():
    """With the fitted coefficients and the measured mean accepted length, the simulator's verifying step gives
    an ITL speed-up at each batch size. It prices the k + 1 rows but not the proposer's lookup or the rejection
    sampler, which on this tiny CPU model cost more than the rows: the prediction is an upper bound of what the
    engine measured, not an estimate of it (docs/benchmarks/speculative.md gives both)."""
    fitted = StepCoefficients(**SPECULATIVE["plain_step_fit"]["coefficients"])
    measured = measured_speculation(MEASUREMENTS, "ngram")
    plain, speculative = CostModel(fitted), SpeculativeCostModel(fitted, measured.speculation)
    assert set(measured.itl_speedup) == set(SPECULATIVE["args"]["batches"])
    for batch, speedup in measured.itl_speedup.items():
        predicted = mean_decode_time(plain, batch) / mean_decode_time(speculative, batch)
        assert speedup <= predicted, (batch, predicted, speedup)


def test_a_verifying_step_computes_k_plus_1_rows_and_yields_the_accepted_length():
    c = StepCoefficients(1e-3, 1e-5, 2e-5, 1e-8, 5e-3, 2e-8)
    plain, spec = CostModel(c), SpeculativeCostModel(c, Speculation(4, 3.0, "test"))
    verify = StepBatch()
    for _ in range(8):
        verify.add_chunk(100, 5)  # what the engine computes: 5 rows after 100 tokens
    assert spec.decode_time(8, 8 * 101) == pytest.approx(plain.step_time(verify) / 3.0)
    assert spec.decode_times(8, 800, 8, 3) == [spec.decode_time(8, 800 + 8 * i) for i in range(3)]
    prefill = StepBatch()
    prefill.add_chunk(0, 512)
    assert spec.step_time(prefill) == plain.step_time(prefill)  # nothing to verify: priced as before


def test_acceptance_rate_gives_the_expected_accepted_length():
    setup = config.parse(tiny(levers={"speculative": {"num_speculative_tokens": 2, "acceptance_rate": 0.5}}))
    assert setup.cost.accepted == 1 + 0.5 + 0.25


@pytest.mark.parametrize(
    "levers, message",
    [
        ({"speculative": "medusa"}, "levers.speculative must be one of ngram, draft"),
        ({"speculative": {"num_speculative_tokens": 4}}, "give one of mean_accepted_length and acceptance_rate"),
        ({"speculative": {"num_speculative_tokens": 2, "mean_accepted_length": 4}}, "mean_accepted_length must be"),
        ({"speculative": {"num_speculative_tokens": 0, "acceptance_rate": 0.5}}, "num_speculative_tokens"),
        ({"kv_capacity": "guess"}, "levers.kv_capacity must be dtype or measured"),
        ({"kv_capacity": "measured", "measurements": "/nonexistent"}, "no measurements at /nonexistent"),
        ({"turbo": True}, "levers: unknown setting(s) turbo"),
    ],
)
def test_bad_levers_are_refused_naming_the_setting(levers, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config.parse(tiny(levers=levers))


def measured_model() -> dict:
    """The benchmark's checkpoint as the simulator's model shape."""
    cfg = KV_CAPACITY["model"]
    return {
        "name": "bench",
        "params": cfg["params"],
        "num_layers": cfg["num_layers"],
        "hidden_size": cfg["hidden_size"],
        "num_heads": cfg["num_heads"],
        "num_kv_heads": cfg["num_kv_heads"],
        "head_dim": cfg["head_dim"],
        "max_model_len": KV_CAPACITY["args"]["max_model_len"],
    }


def budget_as_gpu(weight_bytes: float) -> dict:
    """A GPU whose memory left after the weights is exactly the benchmark's KV budget."""
    return {
        "memory_bytes": KV_CAPACITY["budget_bytes"] + weight_bytes,
        "memory_utilization": 1.0,
        "activation_reserve_bytes": 0,
    }


@pytest.mark.parametrize("kv_dtype, engine_kv", [("fp16", "auto"), ("fp8", "fp8_e4m3")])
def test_predicted_kv_tokens_are_the_engines(kv_dtype, engine_kv):
    """A replica of the benchmark's model in bf16 with the benchmark's budget holds the tokens the engine held."""
    model = measured_model()
    raw = tiny(
        fleet={
            "replicas": 1,
            "model": model,
            "weight_dtype": "fp16",
            "kv_dtype": kv_dtype,
            "hardware": budget_as_gpu(model["params"] * 2),
        },
        workload={"rate": 20, "max_output_tokens": 256},  # within the benchmark's 1,024-token context
        levers={"kv_capacity": "measured"},
    )
    setup = config.parse(raw)
    measured = measured_kv_capacity(MEASUREMENTS).tokens[("bfloat16", engine_kv)]
    assert setup.describe["kv_cache_tokens_per_replica"] == measured


def admitted_at_once(num_blocks: int) -> int:
    """The most sequences a simulated replica holds running after a step, on the benchmark's workload (all added at
    once)."""
    a = KV_CAPACITY["args"]
    clock = SimClock()
    events = EventQueue(clock)
    sink = Collect()
    spec = ReplicaSpec(num_blocks=num_blocks, num_host_blocks=0, scheduler=SchedulerConfig(max_num_seqs=256))
    replica = SimReplica("r0", spec, CostModel(StepCoefficients(1e-3, 0, 1e-6, 0, 0, 0)), events, sink, fast=False)
    sink.replica = replica
    most = [0]
    schedule = replica.scheduler.schedule

    def counting():  # the running list as a step leaves it (what the engine and vLLM are read at)
        most[0] = max(most[0], len(replica.scheduler.running))
        return schedule()

    replica.scheduler.schedule = counting
    requests = []
    for i in range(a["requests"]):
        prompt = [i * 10_000 + j for j in range(a["prompt_len"])]
        answer = [5_000_000 + i * 1000 + j for j in range(a["max_tokens"])]
        requests.append(
            SimRequest(f"r{i}", "paid", "org", "u", 0, prompt, answer, prefix_block_hashes(prompt + answer, 16), 0.0)
        )
    events.at(0.0, replica.add_many, requests)
    events.run()
    return most[0]


@pytest.mark.parametrize(
    "row",
    [r for r in KV_CAPACITY["rows"] if r["engine"] == "tokenfleet"],
    ids=lambda r: f"{r['dtype']}-{r['kv_cache_dtype']}",
)
def test_simulated_admissions_are_the_engines(row):
    """The simulated replica runs the engine's scheduler on as many blocks: it admits as many sequences at once."""
    assert admitted_at_once(row["kv_cache_tokens"] // row["block_size"]) == row["max_running"]
