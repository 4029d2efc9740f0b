"""Loads a Hugging Face checkpoint folder (config.json + *.safetensors, sharded or not) into our model."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tokenfleet.model.config import ModelConfig, WeightQuantization
from tokenfleet.model.cpu_linear import pack_cpu_linears
from tokenfleet.model.llama import LlamaForCausalLM
from tokenfleet.model.parallel import Collectives, TensorShard, parallelize, read_shard, shard_config
from tokenfleet.model.quantized import QuantizedLinear, quantize_per_channel, replace_linears, unpack_int8

log = logging.getLogger(__name__)
GIB = 1 << 30
PROGRESS_FROM_BYTES = 1 << 30  # a checkpoint at least this large logs its progress while it loads
PROGRESS_EVERY_S = 5.0

_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")
# quantized checkpoints' tensors we do not need: activation scales (we compute in 16/32 bits), packed shapes
_QUANT_IGNORED = re.compile(r".*\.(input_scale|weight_shape|weight_zero_point)$")
_EIGHT_BIT = (torch.float8_e4m3fn, torch.int8)
# HF name (without the "model." prefix) -> (our name, index of the slice inside a fused weight or None)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    quantization: str | None = None,
    shard: tuple[TensorShard, Collectives] | None = None,
) -> LlamaForCausalLM:
    """`quantization` (fp8 | int8): quantize a full-precision checkpoint's linear weights while loading; a
    checkpoint that config.json says is quantized loads its 8-bit weights as they are. `shard`: tensor parallel,
    this rank's shard of the model and the group it computes with (model/parallel.py); only its slices are read."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    config = ModelConfig.from_dir(path)
    scheme = _weight_quantization(config, quantization)
    dtype = dtype or config.dtype
    device = torch.device(device)
    with torch.device("meta"):
        if shard is None:
            model = LlamaForCausalLM(config, max_positions)
        else:  # tensor parallel: the rank's share of heads and columns, its layers swapped for the parallel ones
            model = LlamaForCausalLM(shard_config(config, shard[0]), max_positions)
            parallelize(model, *shard)
    if scheme is not None:
        replace_linears(model, scheme, _checkpoint_module_names(model))
        log.info("linear weights in 8 bits: %s %s, dequantized on the fly", scheme.method, scheme.weight_type)
    _materialize(model, dtype, device)
    model.rope.build(device)
    loaded = _load_weights(model, path, scheme, shard[0] if shard is not None else None)
    _check_complete(model, loaded)
    if device.type == "cpu":
        pack_cpu_linears(model)
    return model.eval()


def _weight_quantization(config: ModelConfig, online: str | None) -> WeightQuantization | None:
    if online is None:
        return config.quantization
    if config.quantization is not None:
        raise ValueError(
            f"quantization {online!r} asks to quantize at load, but the checkpoint is already quantized "
            f"(quant_method {config.quantization.method}); leave quantization unset to load it as it is"
        )
    return WeightQuantization.for_online(online)


def _checkpoint_module_names(model: LlamaForCausalLM) -> dict[str, list[str]]:
    """Our linear module name -> the checkpoint's names of the modules fused into it."""
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            parts = [hf for hf, (fused, _) in _FUSED.items() if name.endswith(fused)]
            prefix = "" if name.startswith("lm_head") else "model."
            names[name] = [prefix + name.replace(_FUSED[hf][0], hf) for hf in parts] or [prefix + name]
    return names


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Uninitialized storage of `dtype` on `device` for every parameter the model was built with on the meta
    device (the checkpoint fills them); 8-bit weights and their scales keep their own dtype. Made with
    torch.empty: Module.to_empty's empty_like of meta tensors goes through PyTorch's Python reference ops, whose
    first use imports sympy, seconds of start-up."""
    for module in model.modules():
        keeps = getattr(module, "KEEPS_DTYPE", ())
        for name, param in list(module.named_parameters(recurse=False)):
            storage = torch.empty(param.shape, dtype=param.dtype if name in keeps else dtype, device=device)
            module.register_parameter(name, torch.nn.Parameter(storage, requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        files = [path / name for name in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"weights listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (tokenfleet loads safetensors checkpoints)")
    return files


def _load_weights(
    model: LlamaForCausalLM, path: Path, scheme: WeightQuantization | None, shard: TensorShard | None = None
) -> set[str]:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = weight_files(path)
    progress = LoadProgress(path, sum(f.stat().st_size for f in files), len(files))
    for index, file in enumerate(files):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name) if shard is None else read_shard(f, name, shard)
                    loaded.update(_place(model, params, name, tensor, scheme))
                    progress.advance(tensor.numel() * tensor.element_size(), index)
        except (OSError, SafetensorError) as e:
            raise ValueError(f"cannot read weights file {file}: {e}") from e
    progress.finish()
    return loaded


class LoadProgress:
    """Log lines while a large checkpoint loads: what it is, then every few seconds how far, then how long it
    took. A small one loads silently."""

    def __init__(self, path: Path, total_bytes: int, num_files: int) -> None:
        self.total_bytes, self.num_files = total_bytes, num_files
        self.done_bytes = 0
        self.started = self.last_report = time.monotonic()
        self.shown = total_bytes >= PROGRESS_FROM_BYTES
        if self.shown:
            log.info("loading %.1f GiB of weights from %d file(s) in %s", total_bytes / GIB, num_files, path)

    def advance(self, num_bytes: int, file_index: int) -> None:
        self.done_bytes += num_bytes
        now = time.monotonic()
        if self.shown and now - self.last_report >= PROGRESS_EVERY_S:
            self.last_report = now
            log.info(
                "loading weights: %d%% (%.1f of %.1f GiB, file %d of %d), %.0f s",
                min(100, 100 * self.done_bytes // max(1, self.total_bytes)),
                self.done_bytes / GIB,
                self.total_bytes / GIB,
                file_index + 1,
                self.num_files,
                now - self.started,
            )

    def finish(self) -> None:
        if self.shown:
            log.info("loaded %.1f GiB of weights in %.1f s", self.done_bytes / GIB, time.monotonic() - self.started)


def _place(
    model: LlamaForCausalLM, params: dict, name: str, tensor: torch.Tensor, scheme: WeightQuantization | None
) -> list[str]:
    """Copies one checkpoint tensor into its parameter (or its slice of a fused one); returns the names of the
    parameters (or "name#part" slices) it filled."""
    if _IGNORED.match(name) or (scheme is not None and _QUANT_IGNORED.match(name)):
        return []
    if name == "lm_head.weight" and model.lm_head is None:
        return []  # tied embeddings: some checkpoints still store the copy
    if name.endswith(".weight_packed"):
        name = name.removesuffix("_packed")
    ours, part = _our_name(name)
    if ours not in params:
        log.warning("ignoring unexpected weight %s", name)
        return []
    module = model.get_submodule(ours.rpartition(".")[0])
    if isinstance(module, QuantizedLinear):
        return _place_quantized(model, module, ours, part, name, tensor, scheme)
    if tensor.dtype in _EIGHT_BIT and tensor.dtype != params[ours].dtype:
        raise ValueError(
            f"weight {name} is stored in {tensor.dtype} but config.json has no quantization_config that covers it"
        )
    _copy_into(model, params[ours].data, ours, part, name, tensor)
    return [_slice_name(ours, part)]


def _place_quantized(
    model: LlamaForCausalLM,
    module: QuantizedLinear,
    ours: str,
    part: int | None,
    name: str,
    tensor: torch.Tensor,
    scheme: WeightQuantization | None,
) -> list[str]:
    assert scheme is not None
    prefix, _, param_name = ours.rpartition(".")
    scale_name = f"{prefix}.weight_scale"
    if param_name == "weight" and scheme.online:
        quantized, scale = quantize_per_channel(tensor, module.weight.dtype)
        _copy_into(model, module.weight.data, ours, part, name, quantized)
        _copy_into(model, module.weight_scale.data, scale_name, part, name, scale)
        return [_slice_name(ours, part), _slice_name(scale_name, part)]
    if param_name == "weight":
        if scheme.packed:
            shape = tuple(_destination(model, module.weight.data, ours, part).shape)
            tensor = unpack_int8(tensor, shape)  # type: ignore[arg-type]
        if tensor.dtype != module.weight.dtype:
            raise ValueError(
                f"weight {name} is stored in {tensor.dtype}, but quant_method {scheme.method} says "
                f"{module.weight.dtype}"
            )
    elif param_name == "weight_scale":
        channels = int(_destination(model, module.weight_scale.data, ours, part).shape[0])
        if tensor.numel() not in (1, channels):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}: neither per-tensor nor one per output channel")
        tensor = tensor.to(torch.float32).reshape(-1, 1).expand(channels, 1)
    _copy_into(model, getattr(module, param_name).data, ours, part, name, tensor)
    return [_slice_name(ours, part)]


def _destination(model: LlamaForCausalLM, data: torch.Tensor, ours: str, part: int | None) -> torch.Tensor:
    return data if part is None else _fused_slice(model, ours, data, part)


def _copy_into(
    model: LlamaForCausalLM, data: torch.Tensor, ours: str, part: int | None, name: str, tensor: torch.Tensor
) -> None:
    dest = _destination(model, data, ours, part)
    if dest.shape != tensor.shape:
        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)


def _slice_name(ours: str, part: int | None) -> str:
    return ours if part is None else f"{ours}#{part}"


def _our_name(name: str) -> tuple[str, int | None]:
    name = name.removeprefix("model.")
    for hf, (fused, part) in _FUSED.items():
        if f".{hf}." in name:
            return name.replace(hf, fused), part
    return name, None


def _fused_slice(model: LlamaForCausalLM, name: str, data: torch.Tensor, part: int) -> torch.Tensor:
    config = model.config
    if "qkv_proj" in name:
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [config.intermediate_size] * 2
    start = sum(sizes[:part])
    return data[start : start + sizes[part]]


def _check_complete(model: LlamaForCausalLM, loaded: set[str]) -> None:
    missing = []  # named as the checkpoint names them (model.layers.0.self_attn.k_proj.weight), not as we fuse them
    for name, _ in model.named_parameters():
        parts = 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else 0
        wanted = [f"{name}#{i}" for i in range(parts)] if parts else [name]
        missing += [_checkpoint_name(w) for w in wanted if w not in loaded]
    if missing:
        raise ValueError(
            f"checkpoint is missing weights for: {', '.join(missing[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )


def _checkpoint_name(ours: str) -> str:
    """Our parameter name (with "#part" for a slice of a fused weight) -> the Hugging Face checkpoint's name."""
    name, _, part = ours.partition("#")
    for hf, (fused, index) in _FUSED.items():
        if part and f".{fused}." in name and index == int(part):
            name = name.replace(fused, hf)
            break
    return name if name.startswith("lm_head.") else f"model.{name}"
