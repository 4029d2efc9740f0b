"""The model's shape, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

DTYPE_NAMES = {  # what config.json and --dtype may say -> the torch dtype's name
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


def canonical_dtype(name: str) -> str:
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of float32, bfloat16, float16")
    return DTYPE_NAMES[name]


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    import torch  # here, not at the top: the gateway reads checkpoints' configs without PyTorch

    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, canonical_dtype(name))


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    dtype_name: str  # the weights' dtype: float32, bfloat16 or float16
    eos_token_ids: list[int]
    quantization: WeightQuantization | None = None  # the checkpoint's own (config.json's quantization_config)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in checkpoint folder {path}")
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        arch = (raw.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; tokenfleet runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            rope_scaling=_rope_scaling(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=family in ("llama", "qwen3") and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=_sliding_window(raw, family),
            dtype_name=canonical_dtype(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            quantization=parse_quantization_config(raw.get("quantization_config")),
        )

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype_name)

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly: a sliding window is not applied, so it caps the length instead."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


ONLINE_QUANTIZATIONS = ("fp8", "int8")  # --quantization: the checkpoint's linear weights quantized at load
CHECKPOINT_QUANTIZATIONS = ("fp8", "compressed-tensors")  # quantization_config.quant_method values we load
# compressed-tensors formats whose 8-bit weights we read: stored as int8/float8 tensors, or int8 packed into int32
COMPRESSED_FORMATS = ("int-quantized", "float-quantized", "naive-quantized", "pack-quantized")


@dataclass(frozen=True)
class WeightQuantization:
    """8-bit weights of the decoder's linear layers, dequantized on the fly: `weight_type` float (float8_e4m3fn) or
    int (int8, symmetric), a scale per tensor or per output channel. `method` says where it came from: a
    checkpoint's quant_method (fp8, compressed-tensors) or `online` (quantized at load from full precision)."""

    method: str
    weight_type: str  # "float" | "int"
    packed: bool = False  # compressed-tensors pack-quantized: `weight_packed` int32 words of four int8 values
    ignore: tuple[str, ...] = ()  # module names left unquantized (exact, or "re:" + a regular expression)

    @property
    def online(self) -> bool:
        return self.method == "online"

    @classmethod
    def for_online(cls, name: str) -> WeightQuantization:
        if name not in ONLINE_QUANTIZATIONS:
            raise ValueError(f"quantization {name!r} is not supported; choose one of {', '.join(ONLINE_QUANTIZATIONS)}")
        return cls("online", "float" if name == "fp8" else "int")


def parse_quantization_config(raw: dict | None) -> WeightQuantization | None:
    """config.json's quantization_config -> what we load, or a ValueError naming what we cannot (never a model
    silently run with weights it misreads)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config must be an object, got {type(raw).__name__}")
    method = raw.get("quant_method")
    if method not in CHECKPOINT_QUANTIZATIONS:
        raise ValueError(
            f"unsupported quantization_config.quant_method {method!r}; tokenfleet loads "
            f"{', '.join(CHECKPOINT_QUANTIZATIONS)} checkpoints (8-bit weights)"
        )
    if method == "fp8":
        return _fp8_config(raw)
    return _compressed_tensors_config(raw)


def _fp8_config(raw: dict) -> WeightQuantization:
    if raw.get("weight_block_size"):
        raise ValueError("quant_method fp8 with weight_block_size (block-wise scales) is not supported")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quant_method fp8 with fmt {fmt!r} is not supported; only e4m3 weights")
    ignore = raw.get("ignored_layers") or raw.get("modules_to_not_convert") or []
    return WeightQuantization("fp8", "float", ignore=tuple(ignore))


def _compressed_tensors_config(raw: dict) -> WeightQuantization:
    fmt = raw.get("format")
    if fmt not in COMPRESSED_FORMATS:
        raise ValueError(
            f"quant_method compressed-tensors with format {fmt!r} is not supported; "
            f"choose one of {', '.join(COMPRESSED_FORMATS)}"
        )
    groups = list((raw.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"quant_method compressed-tensors: expected one config group, got {len(groups)}")
    group = groups[0]
    weights = group.get("weights") or {}
    problems = []
    if "Linear" not in (group.get("targets") or []):
        problems.append(f"targets {group.get('targets')!r} (only Linear)")
    if weights.get("num_bits") != 8:
        problems.append(f"num_bits {weights.get('num_bits')!r} (only 8)")
    if weights.get("type") not in ("int", "float"):
        problems.append(f"type {weights.get('type')!r} (int or float)")
    if weights.get("strategy") not in ("tensor", "channel"):
        problems.append(f"strategy {weights.get('strategy')!r} (tensor or channel)")
    if weights.get("symmetric") is False:
        problems.append("asymmetric weights")
    if fmt == "pack-quantized" and weights.get("type") != "int":
        problems.append("pack-quantized float weights")
    if problems:
        raise ValueError(f"quant_method compressed-tensors with unsupported weights: {'; '.join(problems)}")
    return WeightQuantization(
        "compressed-tensors", weights["type"], packed=fmt == "pack-quantized", ignore=tuple(raw.get("ignore") or [])
    )


def _rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict) -> dict | None:
    """transformers 5 writes `rope_parameters`; older checkpoints write `rope_scaling` (with `type` or `rope_type`)."""
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return None if kind == "default" else {**scaling, "rope_type": kind}


def _sliding_window(raw: dict, family: str) -> int | None:
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    if family in ("llama", "qwen3") and not raw.get("use_sliding_window", False):
        return None
    return raw.get("sliding_window")
