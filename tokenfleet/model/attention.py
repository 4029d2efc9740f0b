"""Paged attention in plain PyTorch.

A step's tokens are laid out flat: first one token per decoding sequence, then each prefill chunk. New keys and
values are written into the paged cache through `slot_mapping`; decodes then attend in one batched call over
their gathered block tables, and each prefill chunk attends over its own context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int  # offset of the chunk in the step's flat token layout
    query_len: int
    context_len: int  # tokens of this sequence with KV after this step (cached + chunk)
    slot_index: torch.Tensor | None  # [context_len] cache slots to gather; None when the chunk is the whole context
    mask: torch.Tensor | None  # [query_len, context_len] bool, None when plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decodes: int
    decode_slot_index: torch.Tensor | None  # [D, L] cache slots of each decode's context, padded
    decode_mask: torch.Tensor | None  # [D, 1, 1, L] bool, True where a slot is part of the context
    prefills: list[PrefillChunk]


class PagedAttention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, slots, KVH, D]. Returns [T, H*D]."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[:meta.num_decodes] = self._decode(q[:meta.num_decodes], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk)
        return out.view(q.shape[0], -1)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        index = meta.decode_slot_index
        keys = k_cache[index].transpose(1, 2)  # [D, KVH, L, Dh]
        values = v_cache[index].transpose(1, 2)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
                                             scale=self.scale, enable_gqa=True)
        return out.squeeze(2)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        if chunk.slot_index is not None:
            k, v = k_cache[chunk.slot_index], v_cache[chunk.slot_index]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=self.scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
