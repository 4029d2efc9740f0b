"""Which replicas are believed to hold which prompt prefixes: a bounded LRU map from a KV block key to replicas.

The keys are the engine's own chained block hashes (`prefix_block_hashes`), so a key names a whole prefix: a
replica that served block k of a prompt also served blocks 0..k. The index is a belief, not the truth: replicas
evict on their own, and the index forgets least recently used entries only when it is full.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenfleet.engine.kv_blocks import prefix_block_hashes

# Hashing costs ~0.18 ms per 1k tokens (blake2b per 16-token block, measured on the CPU build): an uncapped
# 8k-token prompt takes ~1.5 ms. 128 blocks (2048 tokens at block size 16) stays at ~0.37 ms and is enough to
# tell conversations apart unless their shared prefix alone is longer than that.
DEFAULT_MAX_BLOCKS = 128


def prompt_hashes(
    token_ids: Sequence[int], block_size: int, max_blocks: int | None = DEFAULT_MAX_BLOCKS
) -> list[bytes]:
    """The engine's keys for the prompt's leading full blocks (at most `max_blocks`; None hashes them all)."""
    if max_blocks is not None:
        token_ids = token_ids[: max_blocks * block_size]
    return prefix_block_hashes(token_ids, block_size)


@dataclass(slots=True)
class IndexEntry:
    holders: list[str] = field(default_factory=list)  # newest first
    continuations: int = 0  # distinct next blocks recorded after this one: 2+ means prompts branch off here


class PrefixIndex:
    """Block key -> the replicas that most recently served a prompt containing that block, newest first."""

    def __init__(self, max_entries: int = 100_000, replicas_per_block: int = 4) -> None:
        if max_entries < 1 or replicas_per_block < 1:
            raise ValueError("max_entries and replicas_per_block must be at least 1")
        self.max_entries = max_entries
        self.replicas_per_block = replicas_per_block
        self._entries: OrderedDict[bytes, IndexEntry] = OrderedDict()  # LRU order: front is evicted first

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, hashes: Sequence[bytes], replica: str) -> None:
        """Notes that `replica` now holds these blocks (the leading blocks of one prompt, in order)."""
        entries, keep = self._entries, self.replicas_per_block
        child_is_new = False  # the block after this one was not in the index: this one gains a continuation
        # Deepest block first, so the shared leading blocks end up most recently used and are evicted last:
        # without block 0 the later blocks of the chain can never match again.
        for key in reversed(hashes):
            entry = entries.get(key)
            if entry is None:
                entries[key] = IndexEntry([replica], 1 if child_is_new else 0)  # its only holder so far
                child_is_new = True
                continue
            entries.move_to_end(key)
            if child_is_new:
                entry.continuations += 1
                child_is_new = False
            holders = entry.holders
            if holders and holders[0] == replica:  # already the newest holder (a conversation's next turn)
                continue
            if replica in holders:
                holders.remove(replica)
            holders.insert(0, replica)
            del holders[keep:]
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def matches(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per replica, how many leading blocks of the prompt it is believed to hold (replicas with none omitted)."""
        matched: dict[str, int] = {}
        get = self._entries.get
        holders: list[str] = []  # the holders of the last blocks walked (long runs of blocks share them)
        depth = 0
        for key in hashes:
            entry = get(key)
            if entry is None or not entry.holders:
                break
            if entry.holders != holders:
                for replica in holders:
                    matched[replica] = depth  # chained keys: holding block k means holding blocks 0..k
                holders = entry.holders
            depth += 1
        for replica in holders:
            matched[replica] = depth
        return matched

    def holders(self, key: bytes) -> list[str]:
        """The replicas recorded for one block key, newest first."""
        entry = self._entries.get(key)
        return list(entry.holders) if entry else []

    def continuations(self, key: bytes) -> int:
        """How many different ways recorded prompts went on after this block (0 if it ended them or is unknown)."""
        entry = self._entries.get(key)
        return entry.continuations if entry else 0

    def forget(self, replica: str) -> None:
        """Drops a replica that left the pool from every entry (entries left with no replica go too)."""
        for key in list(self._entries):
            holders = self._entries[key].holders
            if replica in holders:
                holders.remove(replica)
                if not holders:
                    del self._entries[key]
