"""Rotary position embeddings (default, linear and llama3 scaling), as a cos/sin table indexed by position."""

from __future__ import annotations

import math

import torch

from tokenfleet.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r}; tokenfleet supports default, linear and llama3")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    ramp = (original_len / wavelen - low) / (high - low)
    smoothed = (1 - ramp) * scaled / factor + ramp * scaled
    in_between = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(in_between, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config, self.max_positions = config, max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build(torch.device("cpu"))

    def build(self, device: torch.device) -> None:
        """(Re)computes the tables in float32, e.g. after the model was materialised from the meta device."""
        positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inverse_frequencies(self.config))
        table = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = table.cos().to(device), table.sin().to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]; positions: [T]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
