"""Accelerators the cost model knows: peak compute, memory bandwidth and size per GPU, and the link between GPUs.

Peaks are the vendors' dense (no sparsity) figures for the SXM parts. The efficiencies are what serving engines
reach in practice (MFU for large prefill GEMMs, share of HBM bandwidth for decode's streaming reads); they are the
constants a calibration replaces, not measurements of this repository.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from tokenfleet.sim.numbers import is_finite, is_whole

GB = 1e9
TERA = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: float  # per GPU
    hbm_bytes_per_s: float  # per GPU
    flops_fp16: float  # dense peak, per GPU
    flops_fp8: float
    link_bytes_per_s: float = 450 * GB  # NVLink, per GPU per direction (all-reduce bandwidth)
    allreduce_latency_s: float = 8e-6  # per all-reduce, at small messages
    mfu: float = 0.5  # share of peak FLOPs reached by prefill-sized matmuls
    attention_mfu: float = 0.35  # share of peak reached by attention (FlashAttention-class kernels)
    bandwidth_efficiency: float = 0.8  # share of HBM bandwidth reached by decode's weight and KV reads
    link_efficiency: float = 0.7
    step_overhead_s: float = 2e-3  # scheduling, input preparation, sampling, launch gaps: per step
    per_sequence_s: float = 1e-5  # the same, per sequence in the step
    memory_utilization: float = 0.9  # share of GPU memory the engine may use (weights + KV + activations)
    activation_reserve_bytes: float = 4 * GB  # per GPU: activations, CUDA graphs, workspace
    max_tp: int = 8  # GPUs per node joined by the fast link

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "name":
                continue
            value, (low, high) = getattr(self, f.name), RANGES.get(f.name, (">", None))
            number = is_whole(value) if f.name == "max_tp" else is_finite(value)
            ok = number and (value > 0 if low == ">" else value >= 0) and (high is None or value <= high)
            if not ok:
                kind = "a whole number" if f.name == "max_tp" else "a finite number"
                bound = f"in (0, {high}]" if high else f"{low} 0"  # every share is > 0
                raise ValueError(f"{f.name} must be {kind} {bound}, got {value!r}")

    def flops(self, weight_dtype: str) -> float:
        return self.flops_fp8 if weight_dtype == "fp8" else self.flops_fp16

    def with_overrides(self, **changes) -> Hardware:
        unknown = sorted(set(changes) - set(self.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown hardware setting(s) {', '.join(unknown)}")
        return replace(self, **changes)  # __post_init__ checks the values


# what each setting may be: > 0 (the default: rates, sizes, divisors) or >= 0, and at most `high` (shares)
RANGES = {
    "allreduce_latency_s": (">=", None),
    "step_overhead_s": (">=", None),
    "per_sequence_s": (">=", None),
    "activation_reserve_bytes": (">=", None),
    "mfu": (">", 1),
    "attention_mfu": (">", 1),
    "bandwidth_efficiency": (">", 1),
    "link_efficiency": (">", 1),
    "memory_utilization": (">", 1),
}


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "h100", memory_bytes=80 * GB, hbm_bytes_per_s=3.35 * TERA, flops_fp16=989 * TERA, flops_fp8=1979 * TERA
    ),
    "h200": Hardware(
        "h200", memory_bytes=141 * GB, hbm_bytes_per_s=4.8 * TERA, flops_fp16=989 * TERA, flops_fp8=1979 * TERA
    ),
}


def hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(sorted(HARDWARE))}") from None
