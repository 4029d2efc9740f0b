"""The 8-bit (FP8) KV cache: its formats, quantize on write, dequantize on read, and the scales of each layer.

A stored 8-bit value times its layer's scale is the model's key or value. Scales are per layer, one for keys and
one for values, and powers of two: dividing and multiplying by them is exact, so rounding to 8 bits is the only
error, and a scale only decides which range of magnitudes the format's exponent covers. The runner sets them at
start from the largest keys and values of one seeded prefill (engine/runner.py, measure_kv_ranges).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# the largest calibration magnitude maps to at most 1/HEADROOM of the format's largest value: room for inputs
# larger than the calibration prompt's before values saturate
HEADROOM = 4


@dataclass(frozen=True)
class KVScales:
    """One layer's dequantization scales: stored value * scale = the model's value."""

    k: float = 1.0
    v: float = 1.0


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for a `kv_cache_dtype` setting ('auto': the model's own)."""
    if name == "auto":
        return model_dtype
    if name not in FP8_FORMATS:
        raise ValueError(f"kv_cache_dtype {name!r} is not supported; choose auto or one of {', '.join(FP8_FORMATS)}")
    return FP8_FORMATS[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit tensor viewed as uint8 for indexing and copies: PyTorch's float8 indexing kernels are missing on
    some devices and versions, byte ones are not. Other tensors are returned as they are."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in an 8-bit format; out-of-range values saturate (a plain cast gives NaN or inf)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Back to the model's dtype: every 8-bit value is exact in bf16, fp16 and fp32."""
    return stored.to(dtype).mul_(scale)


def scale_for(amax: float, dtype: torch.dtype) -> float:
    """The smallest power of two that maps `amax` to at most 1/HEADROOM of the format's largest value."""
    if not amax > 0 or not math.isfinite(amax):
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * HEADROOM / torch.finfo(dtype).max))
