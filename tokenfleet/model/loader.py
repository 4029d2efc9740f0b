"""Loads a Hugging Face checkpoint folder (config.json + *.safetensors, sharded or not) into our model."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tokenfleet.model.config import ModelConfig
from tokenfleet.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)
GIB = 1 << 30
PROGRESS_FROM_BYTES = 1 << 30  # a checkpoint at least this large logs its progress while it loads
PROGRESS_EVERY_S = 5.0

_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")
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
) -> LlamaForCausalLM:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    config = ModelConfig.from_dir(path)
    dtype = dtype or config.dtype
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions)
    _materialize(model, dtype, device)
    model.rope.build(device)
    loaded = _load_weights(model, path)
    _check_complete(model, loaded)
    return model.eval()


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Uninitialized storage of `dtype` on `device` for every parameter the model was built with on the meta
    device (the checkpoint fills them). Made with torch.empty: Module.to_empty's empty_like of meta tensors goes
    through PyTorch's Python reference ops, whose first use imports sympy, seconds of start-up."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            storage = torch.empty(param.shape, dtype=dtype, device=device)
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


def _load_weights(model: LlamaForCausalLM, path: Path) -> set[str]:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = weight_files(path)
    progress = LoadProgress(path, sum(f.stat().st_size for f in files), len(files))
    for index, file in enumerate(files):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    target = _place(model, params, name, tensor)
                    if target:
                        loaded.add(target)
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


def _place(model: LlamaForCausalLM, params: dict, name: str, tensor: torch.Tensor) -> str | None:
    """Copies one checkpoint tensor into its parameter (or its slice of a fused one); returns the parameter name."""
    if _IGNORED.match(name):
        return None
    if name == "lm_head.weight" and model.lm_head is None:
        return None  # tied embeddings: some checkpoints still store the copy
    ours, part = _our_name(name)
    if ours not in params:
        log.warning("ignoring unexpected weight %s", name)
        return None
    param = params[ours]
    dest = param.data if part is None else _fused_slice(model, ours, param.data, part)
    if dest.shape != tensor.shape:
        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)
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
