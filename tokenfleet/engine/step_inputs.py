"""A step's flat model inputs: decode rows first, then prefill chunks, with their attention metadata.

With the CPU kernel, a step's prefill chunks attend in one call per layer straight over the paged cache (a
PrefillBatch); without it, each chunk attends alone over its gathered context.

A decode row is one token attended over its paged context as a decode. A request that decodes with speculative
proposals gives one row per token it computes (its last token, then each proposal), each attending to the
context up to its own position: every row's key and value are written into the cache before any row attends, so
the rows of one request see each other causally, and a verification runs through the same decode path (the CPU
kernel) as a plain decode, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenfleet.engine.request import Request
from tokenfleet.engine.scheduler import ScheduledChunk
from tokenfleet.model.attention import AttentionMetadata, DecodeGroup, PrefillBatch, PrefillChunk


@dataclass
class DecodeRow:
    req: Request
    token: int
    position: int  # attends to the request's tokens 0..position


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # the flat rows whose logits the step returns, in this order
    sampled: list[ScheduledChunk]  # the chunks those logits belong to: 1 + len(spec_token_ids) rows each


def decode_rows(chunk: ScheduledChunk) -> list[DecodeRow]:
    """A decoding chunk's rows: its next token, then each of its proposals."""
    req, p = chunk.req, chunk.req.num_computed_tokens
    tokens = [req.token_ids[p], *chunk.spec_token_ids]
    return [DecodeRow(req, token, p + i) for i, token in enumerate(tokens)]


def is_decode(chunk: ScheduledChunk) -> bool:
    return chunk.num_tokens - chunk.num_lookahead == 1


class InputBuilder:
    """Builds StepInputs for one model: its block size, device, dtype, and whether decodes go through a fused
    kernel (which takes every row at once) or the PyTorch path (which pads, so rows are grouped by length)."""

    def __init__(self, block_size: int, device: torch.device, dtype: torch.dtype, uses_kernel: bool) -> None:
        self.block_size, self.device, self.dtype, self.uses_kernel = block_size, device, dtype, uses_kernel

    def for_chunks(self, chunks: Sequence[ScheduledChunk]) -> StepInputs:
        """The scheduled chunks' inputs; logits for every row of a decoding chunk and the last row of a prefill
        chunk that reaches its request's end."""
        decodes = [c for c in chunks if is_decode(c)]
        rows_of = [decode_rows(c) for c in decodes]
        prefills = [c for c in chunks if not is_decode(c)]
        flat_of_row, ids, positions, blocks, offsets, groups = self._rows([r for rows in rows_of for r in rows])
        logits: list[int] = []
        sampled: list[ScheduledChunk] = []
        next_row = 0
        for chunk, rows in zip(decodes, rows_of):
            if chunk.samples:
                logits.extend(flat_of_row[next_row : next_row + len(rows)])
                sampled.append(chunk)
            next_row += len(rows)
        prefill_meta = []
        batch = self._prefill_batch(len(ids), prefills) if self.uses_kernel and prefills else None
        for chunk in prefills:
            req, start, n = chunk.req, chunk.req.num_computed_tokens, chunk.num_tokens
            table = torch.tensor(req.block_table)
            pos = torch.arange(start, start + n)
            if batch is None:  # the kernel's batch holds all it needs; a chunk without its context would be wrong
                prefill_meta.append(self._prefill_chunk(len(ids), start, n, table))
            ids.extend(req.token_ids[start : start + n])
            positions.append(pos)
            blocks.append(table[pos // self.block_size])
            offsets.append(pos % self.block_size)
            if chunk.samples:
                logits.append(len(ids) - 1)
                sampled.append(chunk)
        return self._inputs(ids, positions, blocks, offsets, groups, prefill_meta, logits, sampled, batch)

    def for_rows(self, rows: Sequence[DecodeRow]) -> StepInputs:
        """Decode rows alone (a draft model's pass), logits for every row in the given order."""
        flat_of_row, ids, positions, blocks, offsets, groups = self._rows(rows)
        return self._inputs(ids, positions, blocks, offsets, groups, [], flat_of_row, [])

    def _inputs(
        self,
        ids: list[int],
        positions: list[torch.Tensor],
        blocks: list[torch.Tensor],
        offsets: list[torch.Tensor],
        groups: list[DecodeGroup],
        prefills: list[PrefillChunk],
        logits: list[int],
        sampled: list[ScheduledChunk],
        batch: PrefillBatch | None = None,
    ) -> StepInputs:
        meta = AttentionMetadata(
            torch.cat(blocks).to(self.device),
            torch.cat(offsets).to(self.device),
            self.block_size,
            groups,
            prefills,
            batch,
        )
        return StepInputs(
            torch.tensor(ids, device=self.device),
            torch.cat(positions).to(self.device),
            meta,
            torch.tensor(logits, dtype=torch.long, device=self.device),
            sampled,
        )

    def _rows(
        self, rows: Sequence[DecodeRow]
    ) -> tuple[list[int], list[int], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[DecodeGroup]]:
        """The rows laid out flat, sorted by context length (the PyTorch path pads each group to its longest):
        each row's flat index, token ids (a list to extend), position/block/offset tensors (lists to extend) and
        the decode groups."""
        order = sorted(range(len(rows)), key=lambda i: rows[i].position)
        flat_of_row = [0] * len(rows)
        for flat, i in enumerate(order):
            flat_of_row[i] = flat
        laid = [rows[i] for i in order]
        bs = self.block_size
        positions = torch.tensor([r.position for r in laid], dtype=torch.long)
        blocks = torch.tensor([r.req.block_table[r.position // bs] for r in laid], dtype=torch.long)
        return (
            flat_of_row,
            [r.token for r in laid],
            [positions],
            [blocks],
            [positions % bs],
            self._decode_groups(laid),
        )

    def _decode_groups(self, rows: list[DecodeRow]) -> list[DecodeGroup]:
        """The kernel takes all rows at once; the PyTorch path pads, so it splits the (context-sorted) rows into up
        to 4 equal runs, each padded only to its own longest."""
        max_groups = 1 if self.uses_kernel else 4
        groups, size = [], -(-len(rows) // max_groups) if rows else 0
        for start in range(0, len(rows), max(size, 1)):
            groups.append(self._decode_group(start, rows[start : start + size]))
        return groups

    def _decode_group(self, start: int, rows: list[DecodeRow]) -> DecodeGroup:
        context_lens = [r.position + 1 for r in rows]
        width = -(-max(context_lens) // self.block_size)
        tables = [r.req.block_table[:width] for r in rows]
        tables = [t + [0] * (width - len(t)) for t in tables]
        lens = torch.tensor(context_lens)
        mask = None
        if not self.uses_kernel:
            mask = self._additive(torch.arange(width * self.block_size) >= lens.unsqueeze(1))[None, :, None, :]
        return DecodeGroup(start, torch.tensor(tables, dtype=torch.long).to(self.device), lens.to(self.device), mask)

    def _additive(self, hidden: torch.Tensor) -> torch.Tensor:
        """A boolean 'masked out' tensor as an additive attention mask in the model's dtype."""
        mask = torch.zeros(hidden.shape, dtype=self.dtype)
        return mask.masked_fill_(hidden, float("-inf")).to(self.device)

    def _prefill_batch(self, row_start: int, chunks: list[ScheduledChunk]) -> PrefillBatch:
        """The chunks for the kernel: each sequence's table up to the blocks its chunk reaches, padded alike."""
        bs = self.block_size
        starts = [c.req.num_computed_tokens for c in chunks]
        lens = [c.num_tokens for c in chunks]
        widths = [-(-(start + n) // bs) for start, n in zip(starts, lens)]
        width = max(widths)
        tables = [c.req.block_table[:w] + [0] * (width - w) for c, w in zip(chunks, widths)]
        return PrefillBatch(
            row_start,
            torch.tensor(tables, dtype=torch.long, device=self.device),
            torch.tensor(lens, dtype=torch.long, device=self.device),
            torch.tensor(starts, dtype=torch.long, device=self.device),
        )

    def _prefill_chunk(self, query_start: int, start: int, n: int, table: torch.Tensor) -> PrefillChunk:
        if start == 0:
            return PrefillChunk(query_start, n, None, None)
        context = torch.arange(start + n)
        where = (table[context // self.block_size].to(self.device), (context % self.block_size).to(self.device))
        future = context.unsqueeze(0) > torch.arange(start, start + n).unsqueeze(1)
        return PrefillChunk(query_start, n, where, self._additive(future))
