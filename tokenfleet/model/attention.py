"""Paged attention in plain PyTorch (and through the CPU kernel for decodes).

A step's tokens are laid out flat: first one token per decoding sequence, then each prefill chunk. New keys and
values are written into the paged cache at (block, offset); decodes then attend in batched calls over their block
tables, and each prefill chunk attends over its own context.

One layer's cache is [2, kv_heads, num_blocks, block_size * head_dim]. Inside a block, values are stored
[block_size, head_dim] and keys transposed, [head_dim, block_size], so that the scores of a whole block of
tokens are one vector multiply-add per head dimension in the CPU kernel.

An 8-bit cache (see kv_quant.py) stores keys and values quantized when they are written; attention reads them
dequantized, including a chunk's own new tokens, so a sequence sees the same keys and values whether they were
computed in this step, an earlier chunk, or found in the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenfleet.model.kv_quant import KVScales, as_bytes, dequantize, is_fp8, quantize


@dataclass
class PrefillChunk:
    query_start: int  # offset of the chunk in the step's flat token layout
    query_len: int
    context: tuple[torch.Tensor, torch.Tensor] | None  # (blocks, offsets) of the whole context; None: chunk only
    mask: torch.Tensor | None  # [query_len, context_len] additive (0 / -inf), None when plain causal


@dataclass
class DecodeGroup:
    """Decodes attended in one batched call."""

    start: int  # offset of the group's first token in the step's flat layout
    block_tables: torch.Tensor  # [n, W] block tables of the group's decodes, each padded to W blocks
    context_lens: torch.Tensor  # [n]
    mask: torch.Tensor | None  # [1, n, 1, W * block_size] additive (0 / -inf on padding); None for the kernel

    @property
    def size(self) -> int:
        return self.block_tables.shape[0]


@dataclass
class PrefillBatch:
    """A step's prefill chunks for the CPU kernel, which attends them all in one call straight over the paged cache
    (the chunks' own keys and values are written there first). The chunks' rows are the step's last rows."""

    row_start: int  # the first chunk's first row in the step's flat layout
    block_tables: torch.Tensor  # [C, W] int64, each chunk's sequence's table padded to W blocks
    query_lens: torch.Tensor  # [C] int64
    context_starts: torch.Tensor  # [C] int64: tokens of the sequence before the chunk (its first row's position)


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] block that receives each new token's key and value
    slot_offsets: torch.Tensor  # [T] position inside that block
    block_size: int
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    prefill_batch: PrefillBatch | None = None  # set when the chunks go through the CPU kernel (prefills then empty)


class PagedAttention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, decode_kernel=None) -> None:
        super().__init__()
        self.decode_kernel = decode_kernel  # a fused paged decode op, or None for the PyTorch path
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.kv_scales = KVScales()  # this layer's, set by the runner; used by an 8-bit cache only

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, KVH, blocks, block_size * D]. Returns [T, H*D]."""
        k_blocks, v_blocks = self._blocks(kv_cache, meta.block_size)
        k, v = self._store(k, v, k_blocks, v_blocks, meta)
        out = torch.empty_like(q)
        for group in meta.decodes:
            rows = slice(group.start, group.start + group.size)
            out[rows] = self._decode(q[rows], kv_cache, group, meta.block_size)
        if meta.prefill_batch is not None:
            out[meta.prefill_batch.row_start :] = self._prefill_batch(q, kv_cache, meta.prefill_batch, meta.block_size)
            return out.view(q.shape[0], -1)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_blocks, v_blocks, chunk)
        return out.view(q.shape[0], -1)

    def _prefill_batch(
        self, q: torch.Tensor, kv_cache: torch.Tensor, batch: PrefillBatch, block_size: int
    ) -> torch.Tensor:
        """Every prefill chunk of the step through the CPU kernel (loaded whenever a builder makes a batch)."""
        return torch.ops.tokenfleet.paged_prefill_attention(
            q[batch.row_start :].contiguous(),
            kv_cache[0],
            kv_cache[1],
            batch.block_tables,
            batch.query_lens,
            batch.context_starts,
            block_size,
            self.scale,
            self.kv_scales.k,
            self.kv_scales.v,
        )

    def _store(
        self, k: torch.Tensor, v: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the step's keys and values into their slots; returns them as the cache will give them back."""
        stored_k, stored_v = k, v
        if is_fp8(k_blocks.dtype):
            scales, fmt = self.kv_scales, k_blocks.dtype
            stored_k, stored_v = quantize(k, scales.k, fmt), quantize(v, scales.v, fmt)
            k, v = dequantize(stored_k, scales.k, k.dtype), dequantize(stored_v, scales.v, v.dtype)
        as_bytes(k_blocks)[:, meta.slot_blocks, :, meta.slot_offsets] = as_bytes(stored_k)  # indexed dims first
        as_bytes(v_blocks)[:, meta.slot_blocks, meta.slot_offsets] = as_bytes(stored_v).transpose(0, 1)
        return k, v

    def _load(self, stored: torch.Tensor, cache: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Entries read from `cache` (through as_bytes) in the model's dtype."""
        return dequantize(stored.view(cache.dtype), scale, dtype) if is_fp8(cache.dtype) else stored

    def _blocks(self, kv_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the cache as [KVH, blocks, D, block_size] keys and [KVH, blocks, block_size, D] values."""
        kvh, d = self.num_kv_heads, self.head_dim
        return kv_cache[0].view(kvh, -1, d, block_size), kv_cache[1].view(kvh, -1, block_size, d)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, block_size: int) -> torch.Tensor:
        if group.mask is None:
            return self.decode_kernel(
                q.contiguous(),
                kv_cache[0],
                kv_cache[1],
                group.block_tables,
                group.context_lens,
                block_size,
                self.scale,
                self.kv_scales.k,
                self.kv_scales.v,
            )
        n, width = group.block_tables.shape
        kvh, d = self.num_kv_heads, self.head_dim
        index = group.block_tables.flatten()
        keys_t = self._gather(kv_cache[0], index, self.kv_scales.k, q.dtype).view(kvh, n, width, d, block_size)
        keys_t = keys_t.permute(0, 1, 3, 2, 4).reshape(kvh, n, d, width * block_size)  # K^T of each context
        values = self._gather(kv_cache[1], index, self.kv_scales.v, q.dtype).view(kvh, n, width * block_size, d)
        queries = q.view(n, kvh, self.group, d).transpose(0, 1)  # [KVH, n, G, D]
        scores = torch.matmul(queries, keys_t).mul_(self.scale).add_(group.mask)
        out = torch.matmul(scores.softmax(dim=-1), values)  # [KVH, n, G, D]
        return out.transpose(0, 1).reshape(n, self.num_heads, d)

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """The given blocks of one half of a layer's cache (an 8-bit cache dequantizes only these)."""
        return self._load(as_bytes(cache).index_select(1, blocks), cache, scale, dtype)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        if chunk.context is None:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        else:
            blocks, offsets = chunk.context
            keys = self._load(as_bytes(k_blocks)[:, blocks, :, offsets], k_blocks, self.kv_scales.k, q.dtype)
            keys = keys.transpose(0, 1)  # [KVH, context, D]
            values = self._load(as_bytes(v_blocks)[:, blocks, offsets], v_blocks, self.kv_scales.v, q.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)
