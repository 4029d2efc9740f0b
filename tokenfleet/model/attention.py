"""Paged attention in plain PyTorch.

A step's tokens are laid out flat: first one token per decoding sequence, then each prefill chunk. New keys and
values are written into the paged cache through `slot_mapping`; decodes then attend in a few batched calls over
their gathered block tables (grouped by context length to bound padding), and each prefill chunk attends over
its own context.

The cache of one layer is [2, kv_heads, slots, head_dim] (slot = block * block_size + offset): head-major, so a
gathered block table is already laid out as the [kv_heads, seqs, context, head_dim] batch the matmuls want.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int  # offset of the chunk in the step's flat token layout
    query_len: int
    slot_index: torch.Tensor | None  # [context_len] cache slots to gather; None when the chunk is the whole context
    mask: torch.Tensor | None  # [query_len, context_len] additive (0 / -inf), None when plain causal


@dataclass
class DecodeGroup:
    """Decodes of similar context length, attended in one batched call."""

    start: int  # offset of the group's first token in the step's flat layout
    block_tables: torch.Tensor  # [n, W] block tables of the group's decodes, each padded to W blocks
    context_lens: torch.Tensor  # [n]
    mask: torch.Tensor | None  # [1, n, 1, W * block_size] additive (0 / -inf on padding); None for the kernel

    @property
    def size(self) -> int:
        return self.block_tables.shape[0]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    block_size: int
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]


class PagedAttention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, decode_kernel=None) -> None:
        super().__init__()
        self.decode_kernel = decode_kernel  # a fused paged decode op, or None for the PyTorch path
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, KVH, slots, D]. Returns [T, H*D]."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        out = torch.empty_like(q)
        for group in meta.decodes:
            rows = slice(group.start, group.start + group.size)
            out[rows] = self._decode(q[rows], k_cache, v_cache, group, meta.block_size)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk)
        return out.view(q.shape[0], -1)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
                block_size: int) -> torch.Tensor:
        if group.mask is None:
            return self.decode_kernel(q.contiguous(), k_cache, v_cache, group.block_tables, group.context_lens,
                                      block_size, self.scale)
        n, kvh = group.size, self.num_kv_heads
        blocks = (kvh, -1, block_size * self.head_dim)  # whole blocks per head: contiguous copies
        index = group.block_tables.flatten()
        keys = k_cache.view(blocks).index_select(1, index).view(kvh, n, -1, self.head_dim)
        values = v_cache.view(blocks).index_select(1, index).view(kvh, n, -1, self.head_dim)
        queries = q.view(n, kvh, self.group, self.head_dim).transpose(0, 1)  # [KVH, n, G, D]
        scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(self.scale).add_(group.mask)
        out = torch.matmul(scores.softmax(dim=-1), values)  # [KVH, n, G, D]
        return out.transpose(0, 1).reshape(n, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        if chunk.slot_index is None:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        else:
            keys, values = k_cache[:, chunk.slot_index], v_cache[:, chunk.slot_index]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=self.scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
