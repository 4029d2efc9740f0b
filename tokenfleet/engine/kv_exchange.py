"""An engine's side of disaggregated prefill/decode: exporting a prompt's computed KV blocks, and importing blocks
computed elsewhere into the prefix cache (engine/kv_transfer.py describes the records and why imports are safe)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenfleet.engine.kv_blocks import KVBlockManager, prefix_block_hashes
from tokenfleet.engine.kv_transfer import KVChunk, KVLayout
from tokenfleet.engine.request import Request
from tokenfleet.engine.runner import ModelRunner

SAMPLE_BYTES = 1 << 16  # of each weights file, head and tail, in the checkpoint's fingerprint


class KVExchange:
    def __init__(self, blocks: KVBlockManager, runner: ModelRunner, layout: KVLayout) -> None:
        self.blocks, self.runner, self.layout = blocks, runner, layout

    def export(self, req: Request) -> KVChunk | None:
        """The prompt blocks the request's steps computed since the last export, if any. The block holding the last
        prompt token never goes: the decode side computes that token itself (its prefix cache, like this one's,
        always leaves one)."""
        bs = self.layout.block_size
        usable = (req.num_prompt_tokens - 1) // bs
        done = min(req.num_computed_tokens // bs, usable, len(req.block_table))
        first = req.num_exported_blocks
        if done <= first:
            return None
        req.num_exported_blocks = done
        return KVChunk(first, done - first, self.runner.read_blocks(req.block_table[first:done]))

    def cached_prefix(self, token_ids: list[int]) -> int:
        """Leading full blocks of this prompt that the prefix cache holds."""
        return self.blocks.cached_prefix_length(prefix_block_hashes(token_ids, self.layout.block_size))

    def import_chunk(self, token_ids: list[int], chunk: KVChunk) -> int:
        """Takes the chunk's blocks of the prompt `token_ids` into the prefix cache (those it lacks); returns the
        leading blocks of the prompt it holds now."""
        bs = self.layout.block_size
        if chunk.end_block * bs > len(token_ids):
            raise ValueError(f"KV blocks up to {chunk.end_block} do not fit a prompt of {len(token_ids)} tokens")
        if len(chunk.data) != chunk.num_blocks * self.layout.bytes_per_block:
            raise ValueError(f"{len(chunk.data)} bytes are not {chunk.num_blocks} KV blocks of this layout")
        keys = prefix_block_hashes(token_ids[: chunk.end_block * bs], bs)
        fills = []
        for position in range(chunk.num_blocks):
            block_id = self.blocks.adopt(keys[chunk.first_block + position])
            if block_id is not None:
                fills.append((position, block_id))
        if fills:
            self.runner.write_blocks(chunk.data, chunk.num_blocks, fills)
        return self.blocks.cached_prefix_length(keys)


def checkpoint_fingerprint(model_dir: str) -> str:
    """A short hash of a checkpoint: its config and, for each weights file, its name, size, and first and last
    bytes (the safetensors header names every tensor and its shape; the sampled bytes tell weights apart)."""
    digest = hashlib.blake2b(digest_size=8)
    root = Path(model_dir)
    config = json.loads((root / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(SAMPLE_BYTES))
            f.seek(max(0, size - SAMPLE_BYTES))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def kv_layout_of(model_dir: str, runner: ModelRunner, block_size: int) -> KVLayout:
    cfg = runner.model.config
    return KVLayout(
        checkpoint_fingerprint(model_dir),
        block_size,
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
        str(runner.kv_dtype).removeprefix("torch."),
    )
