"""`tokenfleet simulate --config`: every impossible value is a ValueError naming its setting before anything runs
(config loading only: no simulation here)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import yaml

from tokenfleet.sim import config
from tokenfleet.sim.hardware import hardware
from tokenfleet.sim.workload import WorkloadSpec

INF, NAN = math.inf, math.nan
BASE = {
    "seed": 1,
    "duration_s": 10,
    "drain_s": 10,
    "fleet": {"replicas": 2, "gpu": "h100", "tensor_parallel": 1, "model": "llama-8b", "weight_dtype": "fp16"},
    "workload": {"rate": 5},
}
SHAPE = {"params": 8.0e9, "num_layers": 32, "hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
ZERO_COST = {
    "overhead_s": 0,
    "per_sequence_s": 0,
    "per_token_s": 0,
    "per_attention_pair_s": 0,
    "weights_s": 0,
    "per_kv_token_s": 0,
}


def _with(changes: dict) -> dict:
    raw = copy.deepcopy(BASE)
    for path, value in changes.items():
        node, keys = raw, path.split(".")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return raw


BAD = [
    # infinite or NaN: the run would hang
    ({"duration_s": INF}, "duration_s"),
    ({"duration_s": NAN}, "duration_s"),
    ({"warmup_s": NAN}, "warmup_s"),
    ({"drain_s": INF}, "drain_s"),
    ({"workload.rate": INF}, "rate"),
    ({"workload.peak_at_s": NAN}, "peak_at_s"),
    ({"workload.diurnal_period_s": INF}, "diurnal_period_s"),
    ({"workload.diurnal_amplitude": NAN}, "diurnal_amplitude"),
    ({"workload.tiers": {"free": INF}}, "tiers"),
    ({"workload.tiers": {"enterprise": NAN, "paid": 1}}, "tiers"),
    ({"workload.bursts": [{"at_s": 1, "duration_s": 5, "multiplier": INF}]}, "bursts[0]"),
    ({"workload.bursts": [{"at_s": 1, "duration_s": 5, "multiplier": NAN}]}, "bursts[0]"),
    ({"workload.bursts": [{"at_s": 1, "duration_s": INF, "multiplier": 2}]}, "bursts[0]"),
    ({"workload.bursts": [{"at_s": 1, "duration_s": 5, "multiplier": "x"}]}, "bursts[0].multiplier"),
    ({"workload.think_time_s": NAN}, "think_time_s"),
    ({"workload.think_time_s": INF}, "think_time_s"),
    ({"workload.turns_mean": INF}, "turns_mean"),
    ({"workload.user_tokens_mean": INF}, "user_tokens_mean"),
    ({"workload.output_tokens_mean": NAN}, "output_tokens_mean"),
    ({"workload.length_sigma": NAN}, "length_sigma"),
    ({"workload.cancel_probability": NAN}, "cancel_probability"),
    ({"routing.load_bound": NAN}, "routing.load_bound"),
    ({"routing.load_bound": 0}, "routing.load_bound"),
    ({"fleet.swap_space_gib": INF}, "fleet.swap_space_gib"),
    ({"fleet.swap_space_gib": NAN}, "fleet.swap_space_gib"),
    ({"gateway.load_interval_s": INF}, "gateway.load_interval_s"),
    ({"gateway.load_interval_s": "1e-9"}, "gateway.load_interval_s"),
    ({"autoscale": {"cold_start_s": INF}}, "autoscale.cold_start_s"),
    ({"slo.tpot_s": INF}, "slo.tpot_s"),
    ({"slo.ttft_s": {"paid": INF}}, "slo.ttft_s.paid"),
    ({"engine.watermark": NAN}, "engine.watermark"),
    (
        {
            "disagg": {"prefill_replicas": 1, "decode_replicas": 1, "link_gb_per_s": INF},
            "workload.cancel_probability": 0,
        },
        "disagg.link_gb_per_s",
    ),
    (
        {
            "disagg": {"prefill_replicas": 1, "decode_replicas": 1, "link_efficiency": 2},
            "workload.cancel_probability": 0,
        },
        "disagg.link_efficiency",
    ),
    # hardware overrides: division by zero, strings, shares above 1
    ({"fleet.hardware": {"mfu": 0}}, "fleet.hardware: mfu"),
    ({"fleet.hardware": {"mfu": NAN}}, "fleet.hardware.mfu"),
    ({"fleet.hardware": {"mfu": "0.5x"}}, "fleet.hardware.mfu"),
    ({"fleet.hardware": {"hbm_bytes_per_s": 0}}, "fleet.hardware: hbm_bytes_per_s"),
    ({"fleet.tensor_parallel": 2, "fleet.hardware": {"link_bytes_per_s": 0}}, "fleet.hardware: link_bytes_per_s"),
    ({"fleet.tensor_parallel": 2, "fleet.hardware": {"link_efficiency": 0}}, "fleet.hardware: link_efficiency"),
    ({"fleet.hardware": {"memory_utilization": 2}}, "fleet.hardware: memory_utilization"),
    ({"fleet.hardware": {"activation_reserve_bytes": -1.0e12}}, "fleet.hardware: activation_reserve_bytes"),
    ({"fleet.hardware": {"memory_bytes": -1}}, "fleet.hardware: memory_bytes"),
    ({"fleet.hardware": {"step_overhead_s": -1}}, "fleet.hardware: step_overhead_s"),
    ({"fleet.hardware": {"max_tp": 0}}, "fleet.hardware: max_tp"),
    ({"fleet.hardware": {"max_tp": 2.5}}, "fleet.hardware.max_tp"),
    ({"fleet.hardware": []}, "fleet.hardware"),
    # a cost model
    ({"fleet.cost": ZERO_COST}, "fleet.cost"),
    ({"fleet.cost": {**ZERO_COST, "weights_s": 0.01, "overhead_s": NAN}}, "fleet.cost.overhead_s"),
    ({"fleet.cost": {**ZERO_COST, "weights_s": 0.01, "overhead_s": "x"}}, "fleet.cost.overhead_s"),
    # whole numbers
    ({"workload.max_output_tokens": 1.5}, "max_output_tokens"),
    ({"workload.orgs_per_tier": 2.5}, "orgs_per_tier"),
    ({"workload.users_per_org": 2.5}, "users_per_org"),
    ({"workload.system_prompts": 1.5}, "system_prompts"),
    ({"workload.system_prompt_tokens": [100.5, 200.5]}, "system_prompt_tokens"),
    ({"workload.system_prompt_tokens": [100]}, "system_prompt_tokens"),
    ({"seed": "abc"}, "seed"),
    ({"seed": 1.7}, "seed"),
    ({"fleet.replicas": 2.5}, "fleet.replicas"),
    ({"fleet.model": {**SHAPE, "num_layers": 32.5}}, "fleet.model.num_layers"),
    ({"fleet.model": {**SHAPE, "head_dim": 128.5}}, "fleet.model.head_dim"),
    ({"fleet.model": {**SHAPE, "max_model_len": INF}}, "fleet.model.max_model_len"),
    ({"fleet.model": {**SHAPE, "max_model_len": "8k"}}, "fleet.model.max_model_len"),
    ({"fleet.model": {**SHAPE, "params": NAN}}, "fleet.model.params"),
    ({"fleet.model": 5}, "fleet.model"),
    # booleans must be booleans
    ({"engine.enable_prefix_caching": "false"}, "engine.enable_prefix_caching"),
    ({"engine.fast": "no"}, "engine.fast"),
    ({"gateway.quota": "false"}, "gateway.quota"),
    ({"routing.affinity": "false"}, "routing.affinity"),
    ({"routing.affinity": 0}, "routing.affinity"),
    # KV blocks and context
    ({"engine.num_blocks": 10}, "engine.num_blocks"),
    ({"engine.num_blocks": 0}, "engine.num_blocks"),
    ({"workload.max_model_len": 100000}, "workload.max_model_len"),
    # per-tier SLOs
    ({"slo.ttft_s": {"gold": 1}}, "slo.ttft_s"),
    # tensor parallel over more GPUs than KV heads
    (
        {"fleet.model": {**SHAPE, "num_kv_heads": 2, "num_heads": 32}, "fleet.tensor_parallel": 4},
        "split over tensor_parallel 4",
    ),
]


@pytest.mark.parametrize("changes, field", BAD, ids=[str(c) for c, _ in BAD])
def test_an_impossible_value_is_refused_naming_its_setting(changes, field) -> None:
    with pytest.raises(ValueError) as refused:
        config.parse_simulation(_with(changes))
    assert field in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "text, field, value",
    [
        ("workload: {rate: 1e6}", "rate", 1e6),
        ("workload: {rate: '10'}", "rate", 10.0),
        ("workload: {think_time_s: 1e1}", "think_time_s", 10.0),
        ("duration_s: 1e1", "duration_s", 10.0),
    ],
)
def test_numbers_yaml_reads_as_strings_are_numbers(text, field, value) -> None:
    raw = {**copy.deepcopy(BASE), **yaml.safe_load(text)}
    if "workload" in yaml.safe_load(text):
        raw["workload"] = {**BASE["workload"], **raw["workload"]}
    setup = config.parse(raw)
    got = getattr(setup.workload, field) if hasattr(setup.workload, field) else getattr(setup, field)
    assert got == value


def test_a_custom_model_and_hardware_given_in_exponent_notation_load() -> None:
    raw = yaml.safe_load(
        "fleet: {model: {params: 8.0e9, num_layers: 32, hidden_size: 4096, num_heads: 32, "
        "num_kv_heads: 8, head_dim: 128}, hardware: {hbm_bytes_per_s: 3.35e12, mfu: '0.5'}}"
    )
    setup = config.parse({**BASE, "fleet": {**BASE["fleet"], **raw["fleet"]}})
    assert setup.describe["model"] == "custom"


def test_workload_spec_checks_values_when_built_directly() -> None:
    with pytest.raises(ValueError, match="rate"):
        WorkloadSpec(rate=INF)
    with pytest.raises(ValueError, match="max_output_tokens"):
        WorkloadSpec(max_output_tokens=1.5)


def test_hardware_overrides_are_checked() -> None:
    with pytest.raises(ValueError, match="mfu"):
        hardware("h100").with_overrides(mfu=0)
    assert hardware("h100").with_overrides(mfu=0.6).mfu == 0.6


@pytest.mark.parametrize("path", sorted(Path("bench/sim").glob("*.yaml")) + [Path("deploy/sim.example.yaml")], ids=str)
def test_the_shipped_configs_load(path) -> None:
    config.load_simulation(path, 0)
