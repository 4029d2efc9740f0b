"""Model shapes the cost model needs: parameters, layers, attention heads, KV heads, head size, hidden size."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp8": 1, "fp32": 4}


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float  # total parameters (weights read per step, and 2 FLOPs each per token)
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        for field_name in (
            "params",
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_model_len",
        ):
            if not getattr(self, field_name) > 0:
                raise ValueError(f"model {self.name}: {field_name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_heads must be a multiple of num_kv_heads")

    def weight_bytes(self, dtype: str) -> float:
        return self.params * dtype_bytes(dtype)

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V, every layer, every KV head: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)


MODELS: dict[str, ModelShape] = {
    # Llama 3 shapes (grouped-query attention, 8 KV heads of 128)
    "llama-70b": ModelShape("llama-70b", 70.6e9, 80, 8192, 64, 8, 128),
    "llama-8b": ModelShape("llama-8b", 8.03e9, 32, 4096, 32, 8, 128),
}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


def model_shape(name: str) -> ModelShape:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))} (or give its shape)") from None
