"""8-bit weights (W8A16): a Linear that keeps its weight in float8_e4m3fn or int8 with a float32 scale per output
channel, and dequantizes it in forward. Memory holds 1 byte per weight; the matmul runs in the activations' dtype.

A per-tensor scale (as fp8 checkpoints often store it) is kept broadcast over the channels of its slice, so the
fused qkv and gate_up projections hold the q, k, v (gate, up) parts' own scales side by side.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from tokenfleet.model.config import WeightQuantization

WEIGHT_DTYPES = {"float": torch.float8_e4m3fn, "int": torch.int8}
# the decoder's linear layers; embeddings and lm_head stay in the model's dtype (as published fp8 checkpoints do)
QUANTIZED_LAYERS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class QuantizedLinear(nn.Module):
    KEEPS_DTYPE = ("weight", "weight_scale")  # the loader materializes these in their own dtype, not the model's

    def __init__(self, in_features: int, out_features: int, bias: bool, weight_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=weight_dtype), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.to(torch.float32) * self.weight_scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)


def max_value(weight_dtype: torch.dtype) -> float:
    return float(torch.finfo(weight_dtype).max if weight_dtype.is_floating_point else torch.iinfo(weight_dtype).max)


def quantize_per_channel(weight: torch.Tensor, weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-precision [out, in] weight -> (8-bit weight, float32 scale [out, 1]) with weight ~ q * scale."""
    w = weight.to(torch.float32)
    absmax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    scale = absmax / max_value(weight_dtype)
    scaled = w / scale
    if weight_dtype.is_floating_point:
        return scaled.clamp(-max_value(weight_dtype), max_value(weight_dtype)).to(weight_dtype), scale
    return scaled.round().clamp(-127, 127).to(weight_dtype), scale


def unpack_int8(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """compressed-tensors pack-quantized, 8 bits: each int32 word holds four consecutive values, lowest byte first,
    each stored unsigned with an offset of 128."""
    words = packed.to(torch.int64)
    parts = [((words >> (8 * i)) & 0xFF) for i in range(4)]
    unsigned = torch.stack(parts, dim=-1).reshape(packed.shape[0], -1)[:, : shape[1]]
    return (unsigned - 128).to(torch.int8).reshape(shape)


def is_ignored(scheme: WeightQuantization, hf_module: str) -> bool:
    for pattern in scheme.ignore:
        if pattern.startswith("re:") and re.fullmatch(pattern[3:], hf_module):
            return True
        if pattern == hf_module:
            return True
    return False


def replace_linears(model: nn.Module, scheme: WeightQuantization, hf_names: dict[str, list[str]]) -> None:
    """Swaps the decoder's nn.Linear layers for QuantizedLinear (on the meta device, before the weights load).
    `hf_names`: our module name -> the checkpoint's module names fused into it, for the ignore list."""
    weight_dtype = WEIGHT_DTYPES[scheme.weight_type]
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not name.endswith(QUANTIZED_LAYERS):
            continue
        ignored = [is_ignored(scheme, hf) for hf in hf_names[name]]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(f"quantization ignores only part of the fused layer {name}: {', '.join(hf_names[name])}")
        parent_name, _, child = name.rpartition(".")
        with torch.device("meta"):
            replacement = QuantizedLinear(
                module.in_features, module.out_features, module.bias is not None, weight_dtype
            )
        setattr(model.get_submodule(parent_name), child, replacement)


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes held by the weights (and scales) of the decoder's linear layers."""
    total = 0
    for name, module in model.named_modules():
        if name.endswith(QUANTIZED_LAYERS):
            total += sum(p.numel() * p.element_size() for n, p in module.named_parameters() if n != "bias")
    return total
