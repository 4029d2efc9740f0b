"""Quantized copies of a small random checkpoint, written as the published formats store them (the plain `fp8`
quant_method of vLLM/AutoFP8, and compressed-tensors as llm-compressor writes it), each beside a full-precision
"reference" copy whose linear weights are the dequantized 8-bit ones: what the quantized model must compute."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (quantization_config maker, weight dtype, per-channel scales)
FORMATS = {
    "fp8-tensor": ("fp8", torch.float8_e4m3fn, False),
    "fp8-channel": ("fp8", torch.float8_e4m3fn, True),
    "ct-int-channel": ("int-quantized", torch.int8, True),
    "ct-pack-channel": ("pack-quantized", torch.int8, True),
    "ct-float-tensor": ("float-quantized", torch.float8_e4m3fn, False),
}


def is_quantized_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(tuple(f"{linear}.weight" for linear in LINEARS))


def quantize(weight: torch.Tensor, dtype: torch.dtype, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization: (8-bit weight, float32 scale [out, 1] or [] per tensor)."""
    w = weight.float()
    top = float(torch.finfo(dtype).max) if dtype.is_floating_point else 127.0
    absmax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = absmax.clamp(min=1e-12) / top
    scaled = w / scale
    q = scaled.clamp(-top, top).to(dtype) if dtype.is_floating_point else scaled.round().clamp(-127, 127).to(dtype)
    return q, scale


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors pack-quantized at 8 bits: four values a little-endian int32 word, offset by 128."""
    unsigned = (q.to(torch.int16) + 128).to(torch.uint8).contiguous()
    return unsigned.view(torch.int32)


def quantization_config(kind: str, per_channel: bool) -> dict:
    if kind == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    weights = {
        "num_bits": 8,
        "type": "float" if kind == "float-quantized" else "int",
        "strategy": "channel" if per_channel else "tensor",
        "symmetric": True,
        "dynamic": False,
        "group_size": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": kind,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head"],
    }


def write_quantized(source: Path, dest: Path, fmt: str) -> tuple[Path, Path]:
    """(quantized checkpoint, its dequantized full-precision reference) of `source` in format `fmt`."""
    kind, dtype, per_channel = FORMATS[fmt]
    reference = dest.with_name(dest.name + "-reference")
    for folder in (dest, reference):
        shutil.copytree(source, folder)
        for file in folder.glob("*.safetensors"):
            file.unlink()
    stored, dequantized = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if not is_quantized_linear(name):
            stored[name] = dequantized[name] = tensor
            continue
        q, scale = quantize(tensor, dtype, per_channel)
        dequantized[name] = (q.float() * scale).to(tensor.dtype)
        prefix = name.removesuffix(".weight")
        if kind == "pack-quantized":
            stored[f"{prefix}.weight_packed"] = pack_int8(q)
            stored[f"{prefix}.weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int64)
        else:
            stored[name] = q
        stored[f"{prefix}.weight_scale"] = scale if per_channel or kind == "fp8" else scale.reshape(1)
        if kind == "fp8":
            stored[f"{prefix}.input_scale"] = torch.tensor(0.01)  # static activation scale: not used in W8A16
    save_file(stored, str(dest / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(reference / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(kind, per_channel)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest, reference


def write_online_reference(source: Path, dest: Path, method: str) -> Path:
    """The full-precision checkpoint `quantization: method` (fp8 | int8) must compute: per-channel dequantized."""
    dtype = torch.float8_e4m3fn if method == "fp8" else torch.int8
    shutil.copytree(source, dest)
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if is_quantized_linear(name):
            q, scale = quantize(tensor, dtype, per_channel=True)
            tensor = (q.float() * scale).to(tensor.dtype)
        tensors[name] = tensor
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest
