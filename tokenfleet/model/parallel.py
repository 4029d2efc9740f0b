"""Tensor parallelism (Megatron-style) for the Llama-family decoder: one rank's shard of the model.

A rank holds 1/N of the attention heads and KV heads (so 1/N of the paged KV cache), 1/N of the MLP's columns
and 1/N of the vocabulary:
- column-parallel: the fused qkv and gate_up projections keep the rank's output rows (its heads, its MLP columns);
  they are plain nn.Linear layers of the shard's size, built from `shard_config`;
- row-parallel: o_proj and down_proj keep the matching input columns; each rank's partial product is summed by an
  all-reduce, and the bias (held whole by every rank) is added once, after it;
- vocab-parallel: the embedding and the LM head keep the rank's rows of the vocabulary, padded so that every
  rank holds the same number; a token outside the rank's rows embeds to zeros and the all-reduce gives every rank
  the whole embedding; the LM head's logits of the sampled rows are gathered on rank 0 only.
Norms (and q/k norms) are replicated. Each rank reads only its slices from the safetensors files (`read_shard`).

The collectives go through a `Collectives` object (a process group the engine made), so that this module needs no
global torch.distributed state and several groups can live in one process.

Opt-in timing (bench/tensor_parallel.py): with TOKENFLEET_TP_COLLECTIVE_LOG set to a folder, every rank records
each of its collectives (kind, start on the monotonic clock, seconds, payload bytes) in `COLLECTIVE_TIMINGS` and
writes them to that folder as rank<N>-<pid>.json when its process exits.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenfleet.model.config import ModelConfig
from tokenfleet.model.llama import LlamaForCausalLM

# HF checkpoint names -> the dimension a rank takes a slice of (0: output rows, 1: input columns)
_COLUMN_PARALLEL = re.compile(r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW_PARALLEL = re.compile(r".*\.(o_proj|down_proj)\.weight$")
_VOCAB_PARALLEL = re.compile(r"^(model\.embed_tokens|lm_head)\.weight$")
COLLECTIVE_LOG_ENV = "TOKENFLEET_TP_COLLECTIVE_LOG"


class Collectives(Protocol):
    """What the sharded layers need from a process group."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums `tensor` over the ranks, in place."""

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape everywhere), on rank 0; None on the others."""


@dataclass
class CollectiveTimings:
    """This process's collectives, each as (kind, start on time.monotonic(), seconds, payload bytes)."""

    folder: Path
    rank: int = -1
    records: list[tuple[str, float, float, int]] = field(default_factory=list)

    def write(self) -> None:
        path = self.folder / f"rank{self.rank}-{os.getpid()}.json"
        path.write_text(json.dumps({"rank": self.rank, "pid": os.getpid(), "records": self.records}))


def _collective_timings() -> CollectiveTimings | None:
    folder = os.environ.get(COLLECTIVE_LOG_ENV)
    if not folder:
        return None
    timings = CollectiveTimings(Path(folder))
    atexit.register(timings.write)
    return timings


COLLECTIVE_TIMINGS = _collective_timings()  # None unless TOKENFLEET_TP_COLLECTIVE_LOG is set


def all_reduce(group: Collectives, tensor: torch.Tensor) -> None:
    """group.all_reduce(tensor), timed when COLLECTIVE_TIMINGS is on."""
    if COLLECTIVE_TIMINGS is None:
        group.all_reduce(tensor)
        return
    start = time.monotonic()
    group.all_reduce(tensor)
    _record("all_reduce", start, group.rank, tensor)


def _record(kind: str, start: float, rank: int, tensor: torch.Tensor) -> None:
    assert COLLECTIVE_TIMINGS is not None
    COLLECTIVE_TIMINGS.rank = rank
    COLLECTIVE_TIMINGS.records.append((kind, start, time.monotonic() - start, tensor.numel() * tensor.element_size()))


@dataclass(frozen=True)
class TensorShard:
    rank: int
    world_size: int

    def rows(self, total: int) -> tuple[int, int]:
        """This rank's [start, end) of `total` rows split evenly (`total` divides by the world size)."""
        size = total // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """This rank's [start, end) of the padded vocabulary: every rank holds ceil(vocab / N) rows; the last
        rank's may reach past the vocabulary (those rows are zeros and their logits are dropped)."""
        size = -(-vocab_size // self.world_size)
        return self.rank * size, (self.rank + 1) * size


def check_divisible(config: ModelConfig, size: int) -> None:
    """Raises ValueError when `size` ranks cannot split the model's heads, KV heads or MLP evenly."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    for what, count in (
        ("attention heads", config.num_heads),
        ("KV heads", config.num_kv_heads),
        ("MLP intermediate size", config.intermediate_size),
    ):
        if count % size:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide the model's {count} {what}: each rank takes an equal "
                f"share of its {config.num_heads} attention heads, {config.num_kv_heads} KV heads and "
                f"{config.intermediate_size} MLP columns"
            )


def shard_config(config: ModelConfig, shard: TensorShard) -> ModelConfig:
    """The config one rank's modules are built from: its share of the heads, KV heads and MLP columns (the
    vocabulary stays whole here: the vocab-parallel layers pad and split it themselves)."""
    check_divisible(config, shard.world_size)
    n = shard.world_size
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // n,
        num_kv_heads=config.num_kv_heads // n,
        intermediate_size=config.intermediate_size // n,
    )


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: the rank's input columns of a linear layer."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: Collectives) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        all_reduce(self.group, y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The rank's rows of the embedding; tokens outside them embed to zeros, and the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: TensorShard, group: Collectives) -> None:
        super().__init__()
        self.start, self.end = shard.vocab_rows(vocab_size)
        self.group = group
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill_(outside, 0)
        x = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        all_reduce(self.group, x)
        return x


class LogitsGather:
    """Joins the ranks' vocab-shard logits on rank 0 (cut back to the real vocabulary); the other ranks get their
    own shard back, which nobody reads."""

    def __init__(self, vocab_size: int, group: Collectives) -> None:
        self.vocab_size, self.group = vocab_size, group

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        start, logits = time.monotonic(), logits.contiguous()
        parts = self.group.gather_to_first(logits)
        if COLLECTIVE_TIMINGS is not None:
            _record("gather", start, self.group.rank, logits)
        if parts is None:
            return logits
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


def parallelize(model: LlamaForCausalLM, shard: TensorShard, group: Collectives) -> None:
    """Turns a model built from `shard_config` (on the meta device, before its weights load) into the rank's
    shard: row-parallel output projections, vocab-parallel embedding and LM head."""
    config = model.config
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.o_proj = RowParallelLinear(
            attention.o_proj.in_features, config.hidden_size, attention.o_proj.bias is not None, group
        )
        mlp.down_proj = RowParallelLinear(
            mlp.down_proj.in_features, config.hidden_size, mlp.down_proj.bias is not None, group
        )
    model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard, group)  # type: ignore[assignment]
    if model.lm_head is not None:
        start, end = shard.vocab_rows(config.vocab_size)
        model.lm_head = nn.Linear(config.hidden_size, end - start, bias=False)
    model.gather_logits = LogitsGather(config.vocab_size, group)


def read_shard(f: Any, name: str, shard: TensorShard) -> torch.Tensor:
    """The rank's slice of checkpoint tensor `name` from an open safetensors file (safe_open), read through
    get_slice so that the rest of the tensor is never read; a replicated tensor whole."""
    view = f.get_slice(name)
    shape = view.get_shape()
    if _COLUMN_PARALLEL.match(name):
        start, end = shard.rows(shape[0])
        return view[start:end]
    if _ROW_PARALLEL.match(name):
        start, end = shard.rows(shape[1])
        return view[:, start:end]
    if _VOCAB_PARALLEL.match(name):
        start, end = shard.vocab_rows(shape[0])
        rows = view[start : min(end, shape[0])]
        padding = end - start - rows.shape[0]
        if padding:
            rows = torch.cat([rows, rows.new_zeros(padding, *rows.shape[1:])])
        return rows
    return f.get_tensor(name)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters (one rank's share, for a shard)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
