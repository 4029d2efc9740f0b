"""`tokenfleet simulate --config sim.yaml`: the YAML, checked before anything runs. Every mistake is a ValueError
naming the setting (negative rates, unknown GPUs or models, a model that does not fit its GPUs at that tensor
parallel degree, unknown keys).

Three layouts: a fixed fleet (`fleet.replicas`), one whose size the project's autoscaler sets while it runs
(`autoscale:`), and separate prefill and decode pools (`disagg:`). `experiment:` is left to the bench scripts that
read the same file (bench/sim_experiments.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from tokenfleet.autoscale.settings import AutoscaleSettings
from tokenfleet.config import default_tiers, section
from tokenfleet.dispatch.overload import OverloadSettings
from tokenfleet.engine.scheduler import SchedulerConfig
from tokenfleet.sim.autoscaling import POOL, ScalingSetup
from tokenfleet.sim.cost_model import CostModel, StepCoefficients, kv_cache_blocks, roofline
from tokenfleet.sim.disagg import DisaggFleet, DisaggSpec
from tokenfleet.sim.fleet import POLICIES, Fleet, FleetSetup
from tokenfleet.sim.hardware import GB, hardware
from tokenfleet.sim.metrics import Slo
from tokenfleet.sim.models import ModelShape, dtype_bytes, model_shape
from tokenfleet.sim.replica import ReplicaSpec
from tokenfleet.sim.workload import Burst, WorkloadSpec

TOP = {"seed", "duration_s", "warmup_s", "drain_s", "fleet", "engine", "routing", "workload", "gateway", "slo",
       "autoscale", "disagg", "experiment"}
FLEET = {"replicas", "gpu", "tensor_parallel", "model", "weight_dtype", "kv_dtype", "hardware", "cost",
         "swap_space_gib"}
ENGINE = {"max_num_seqs", "max_num_batched_tokens", "block_size", "swap_threshold_tokens", "watermark",
          "enable_prefix_caching", "num_blocks", "fast"}
ROUTING = {"policy", "load_bound", "affinity"}
GATEWAY = {"quota", "slots_per_replica", "quantum_tokens", "load_interval_s", "overload"}
SLO = {"ttft_s", "tpot_s"}
AUTOSCALE = {"cold_start_s", "settings"}
DISAGG = {"prefill_replicas", "decode_replicas", "link_gb_per_s", "link_efficiency", "transfer_latency_s",
          "prefill_batched_tokens"}
DEFAULT_TTFT = {"enterprise": 1.0, "paid": 2.0, "free": 5.0, "batch": 600.0}


@dataclass
class Simulation:
    """A checked config: the fleet's setup and its layout (at most one of scaling and disagg)."""

    setup: FleetSetup
    scaling: ScalingSetup | None = None
    disagg: DisaggSpec | None = None

    def fleet(self) -> Fleet:
        return DisaggFleet(self.setup, self.disagg) if self.disagg else Fleet(self.setup)


def load_simulation(path: str | Path, seed: int | None = None) -> Simulation:
    return parse_simulation(_read(path), seed)


def parse_simulation(raw: dict, seed: int | None = None) -> Simulation:
    setup = parse(raw, seed)
    scaling, disagg = raw.get("autoscale"), raw.get("disagg")
    if scaling is not None and disagg is not None:
        raise ValueError("autoscale and disagg cannot be combined: the autoscaler sizes one pool")
    if scaling is not None:
        return Simulation(setup, scaling=_scaling(scaling))
    if disagg is not None:
        return Simulation(setup, disagg=_disagg(disagg, setup))
    return Simulation(setup)


def load(path: str | Path, seed: int | None = None) -> FleetSetup:
    return parse(_read(path), seed)


def _read(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no simulation config at {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a simulation config is a mapping of settings")
    return raw


def _keys(raw: dict | None, known: set[str], where: str) -> dict:
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return raw


def _positive(value, where: str, integer: bool = False, zero: bool = False):
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not (value >= 0 if zero else value > 0):
        kind = "a whole number" if integer else "a number"
        raise ValueError(f"{where} must be {kind} {'>= 0' if zero else '> 0'}, got {value!r}")
    return value


def parse(raw: dict, seed: int | None = None) -> FleetSetup:
    raw = _keys(raw, TOP, "simulation config")
    fleet = _keys(raw.get("fleet"), FLEET, "fleet")
    engine = _keys(raw.get("engine"), ENGINE, "engine")
    routing = _keys(raw.get("routing"), ROUTING, "routing")
    gateway = _keys(raw.get("gateway"), GATEWAY, "gateway")
    duration = _positive(raw.get("duration_s", 600), "duration_s")
    warmup = _positive(raw.get("warmup_s", 0), "warmup_s", zero=True)
    if warmup >= duration:
        raise ValueError("warmup_s must be shorter than duration_s")
    model = _model(fleet.get("model", "llama-70b"))
    spec, cost, describe = _replica(fleet, engine, model)
    workload = _workload(raw.get("workload"), model.max_model_len)
    policy = routing.get("policy", "cache_aware")
    if policy not in POLICIES:
        raise ValueError(f"routing.policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return FleetSetup(
        replicas=_positive(fleet.get("replicas", 1), "fleet.replicas", integer=True), spec=spec, cost=cost,
        workload=workload, tiers=default_tiers(), slo=_slo(raw.get("slo")), duration_s=float(duration),
        seed=int(raw.get("seed", 0) if seed is None else seed), warmup_s=float(warmup),
        drain_s=float(_positive(raw.get("drain_s", 120), "drain_s", zero=True)), policy=policy,
        load_bound=float(routing.get("load_bound", 1.25)), affinity=bool(routing.get("affinity", True)),
        overload=section(OverloadSettings, gateway.get("overload"), "gateway.overload"),
        slots_per_replica=_positive(gateway.get("slots_per_replica", 256), "gateway.slots_per_replica", True),
        quantum_tokens=_positive(gateway.get("quantum_tokens", 2048), "gateway.quantum_tokens", True),
        load_interval_s=float(_positive(gateway.get("load_interval_s", 1.0), "gateway.load_interval_s")),
        quota=bool(gateway.get("quota", True)), fast=bool(engine.get("fast", True)),
        gpus_per_replica=describe["tensor_parallel"], kv_bytes_per_token=model.kv_bytes_per_token(describe["kv_dtype"]),
        describe=describe)


def _scaling(raw) -> ScalingSetup:
    raw = _keys(raw, AUTOSCALE, "autoscale")
    settings = section(AutoscaleSettings, raw.get("settings"), "autoscale.settings")
    unknown = sorted(set(settings.pools) - {POOL})
    if unknown:
        raise ValueError(f"autoscale.settings.pools: the simulated fleet is one pool named {POOL!r}, "
                         f"not {', '.join(unknown)}")
    cold = _positive(raw.get("cold_start_s", settings.cold_start_s), "autoscale.cold_start_s", zero=True)
    return ScalingSetup(settings, cold_start_s=float(cold))


def _disagg(raw, setup: FleetSetup) -> DisaggSpec:
    raw = _keys(raw, DISAGG, "disagg")
    for name in ("prefill_replicas", "decode_replicas"):
        if name not in raw:
            raise ValueError(f"disagg.{name} is required (fleet.replicas is not used with disagg)")
    budget = raw.get("prefill_batched_tokens")
    spec = DisaggSpec(
        _positive(raw["prefill_replicas"], "disagg.prefill_replicas", integer=True),
        _positive(raw["decode_replicas"], "disagg.decode_replicas", integer=True),
        setup.kv_bytes_per_token,
        float(_positive(raw.get("link_gb_per_s", 50), "disagg.link_gb_per_s")) * GB,
        float(_positive(raw.get("link_efficiency", 0.8), "disagg.link_efficiency")),
        float(_positive(raw.get("transfer_latency_s", 0.002), "disagg.transfer_latency_s", zero=True)),
        None if budget is None else _positive(budget, "disagg.prefill_batched_tokens", integer=True))
    if setup.workload.cancel_probability > 0:
        raise ValueError("disagg does not model cancellations: set workload.cancel_probability to 0")
    return spec


def _model(raw) -> ModelShape:
    if isinstance(raw, str):
        return model_shape(raw)
    raw = _keys(raw, {"name", "params", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "max_model_len"}, "fleet.model")
    try:
        return ModelShape(**{"name": "custom", **raw})
    except TypeError as e:
        raise ValueError(f"fleet.model: {e}") from None


def _replica(fleet: dict, engine: dict, model: ModelShape) -> tuple[ReplicaSpec, CostModel, dict]:
    gpu = hardware(str(fleet.get("gpu", "h100")))
    overrides = fleet.get("hardware") or {}
    if not isinstance(overrides, dict):
        raise ValueError("fleet.hardware must be a mapping of hardware settings")
    gpu = gpu.with_overrides(**overrides)
    tp = fleet.get("tensor_parallel", 1)
    weight_dtype, kv_dtype = str(fleet.get("weight_dtype", "fp8")), str(fleet.get("kv_dtype", "fp16"))
    dtype_bytes(weight_dtype), dtype_bytes(kv_dtype)
    block_size = _positive(engine.get("block_size", 16), "engine.block_size", integer=True)
    blocks = kv_cache_blocks(model, gpu, weight_dtype, kv_dtype, tp, block_size)  # also checks tp and the fit
    if "num_blocks" in engine:
        blocks = _positive(engine["num_blocks"], "engine.num_blocks", integer=True)
    cost = fleet.get("cost")
    if cost is not None:
        try:
            coefficients = StepCoefficients(**_keys(cost, set(StepCoefficients.__dataclass_fields__), "fleet.cost"))
        except TypeError as e:
            raise ValueError(f"fleet.cost: {e}") from None
    else:
        coefficients = roofline(model, gpu, weight_dtype, kv_dtype, tp, block_size)
    swap_gib = _positive(fleet.get("swap_space_gib", 4 * tp), "fleet.swap_space_gib", zero=True)
    host_blocks = int(swap_gib * (1 << 30) // (block_size * model.kv_bytes_per_token(kv_dtype)))
    scheduler = SchedulerConfig(
        max_num_seqs=_positive(engine.get("max_num_seqs", 256), "engine.max_num_seqs", integer=True),
        max_num_batched_tokens=_positive(engine.get("max_num_batched_tokens", 2048),
                                         "engine.max_num_batched_tokens", integer=True),
        swap_threshold_tokens=_positive(engine.get("swap_threshold_tokens", 512), "engine.swap_threshold_tokens",
                                        integer=True, zero=True))
    watermark = float(engine.get("watermark", 0.01))
    if not 0 <= watermark < 1:
        raise ValueError(f"engine.watermark must be in [0, 1), got {watermark}")
    spec = ReplicaSpec(blocks, block_size, host_blocks, watermark, bool(engine.get("enable_prefix_caching", True)),
                       model.max_model_len, scheduler)
    cost_model = CostModel(coefficients)
    describe = {"model": model.name, "gpu": gpu.name, "tensor_parallel": tp, "weight_dtype": weight_dtype,
                "kv_dtype": kv_dtype, "kv_cache_tokens_per_replica": blocks * block_size,
                "weights_gb": round(model.weight_bytes(weight_dtype) / GB, 1),
                "decode_step_ms_batch64_ctx2k": round(cost_model.decode_step_time(64, 2000) * 1000, 2),
                "prefill_ms_2048_tokens": round(cost_model.prefill_time(2048) * 1000, 2)}
    return spec, cost_model, describe


def _workload(raw: dict | None, max_model_len: int) -> WorkloadSpec:
    raw = dict(raw or {})
    bursts = raw.pop("bursts", None) or []
    if not isinstance(bursts, list):
        raise ValueError("workload.bursts must be a list of {at_s, duration_s, multiplier}")
    parsed = []
    for i, b in enumerate(bursts):
        b = _keys(b, {"at_s", "duration_s", "multiplier"}, f"workload.bursts[{i}]")
        try:
            parsed.append(Burst(float(b["at_s"]), float(b["duration_s"]), float(b["multiplier"])))
        except KeyError as e:
            raise ValueError(f"workload.bursts[{i}]: missing {e.args[0]}") from None
    if "tiers" in raw and not isinstance(raw["tiers"], dict):
        raise ValueError("workload.tiers must map tier names to shares")
    raw.setdefault("max_model_len", max_model_len)
    workload = section(WorkloadSpec, raw, "workload")
    return WorkloadSpec(**{**{f: getattr(workload, f) for f in WorkloadSpec.__dataclass_fields__},
                           "bursts": tuple(parsed)})


def _slo(raw: dict | None) -> Slo:
    raw = _keys(raw, SLO, "slo")
    ttft = dict(DEFAULT_TTFT)
    given = raw.get("ttft_s", {})
    if not isinstance(given, dict):
        raise ValueError("slo.ttft_s must map tiers to seconds")
    for tier, value in given.items():
        ttft[tier] = float(_positive(value, f"slo.ttft_s.{tier}"))
    return Slo(ttft, float(_positive(raw.get("tpot_s", 0.1), "slo.tpot_s")))
