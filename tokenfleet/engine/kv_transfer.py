"""What moves between engines when prefill and decode run on different replicas: the KV of a prompt's full blocks.

A prefill replica's engine exports each prompt block as soon as a step has computed it (so sending overlaps the
prefill of later chunks); a decode replica's engine imports the blocks as prefix-cache entries, keyed by the same
token hashes its own prefix cache uses, so the decode request that follows finds them as an ordinary prefix hit
and computes only the tail. Imported blocks are free (no request owns them): an import can never leak a block or
starve a running request, only evict older cached prefixes, least recently used first.

Records only, without PyTorch: the server process of a replica reads them (engine/outputs.py says why).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KVLayout:
    """What two engines must share for one's KV blocks to mean the same in the other's cache."""

    model: str  # a fingerprint of the checkpoint's config and weights' names and shapes
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str

    def mismatch(self, other: KVLayout) -> str | None:
        """Why blocks of `other` cannot be used in this layout's cache, or None when they can."""
        differences = [
            f"{name} {mine} here, {theirs} there"
            for name, mine in asdict(self).items()
            if mine != (theirs := getattr(other, name))
        ]
        return "; ".join(differences) or None

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * _dtype_bytes(self.kv_dtype)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object]) -> KVLayout:
        return cls(
            str(data["model"]),
            int(str(data["block_size"])),
            int(str(data["num_layers"])),
            int(str(data["num_kv_heads"])),
            int(str(data["head_dim"])),
            str(data["kv_dtype"]),
        )


@dataclass(frozen=True)
class KVChunk:
    """Consecutive full blocks of one prompt: blocks first_block .. first_block + num_blocks - 1 of it, as the bytes
    of the cache's layout [layers, 2, KV heads, blocks, block_size * head_dim]."""

    first_block: int
    num_blocks: int
    data: bytes

    @property
    def end_block(self) -> int:
        return self.first_block + self.num_blocks


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}.get(dtype, 4)
