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
