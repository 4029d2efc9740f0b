"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, block tables, prefix caching, swap space.

Every device block is in exactly one of two states: owned (its ref count > 0, in one or more block tables) or free
(ref count 0). A free block may still hold a cached prefix (it has a key): it is reused on a prefix hit, or
evicted - least recently used first - when a fresh block is needed.

Fresh blocks are taken in this order: blocks freed without a cached prefix (last freed first: `free_plain`), then
blocks never used yet (in id order), then blocks holding a cached prefix (least recently used first: `free_cached`).
Blocks never used exist only as a count until they are first taken, so a manager of a million blocks costs nothing
up front (the fleet simulator builds hundreds of them).

A block's key is a 128-bit BLAKE2b hash chained over its parent's key and its tokens, so equal keys mean equal
prefixes: a hit is taken on the key alone (finding two prefixes with one key would take ~2^64 hashes, out of reach
even for a tenant trying on purpose), as vLLM does with SHA-256 keys; no copy of the tokens is kept to compare.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice

from tokenfleet.engine.request import Request


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """A block's key: chained over its parent's key and its own tokens, so equal keys mean equal prefixes."""
    digest = hashlib.blake2b(digest_size=16)
    if parent is not None:
        digest.update(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, start: list[bytes] | None = None) -> list[bytes]:
    """Keys of every full block of `token_ids`; `start` holds keys already known for its leading blocks."""
    hashes = list(start or [])
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


class KVBlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_blocks = num_blocks
        # The blocks used so far (ids 0 .. len - 1, in id order), one list per field: walking a table touches two
        # compact arrays instead of one scattered object per block (the fleet simulator holds millions of blocks).
        self.ref_counts: list[int] = []
        self.keys: list[bytes | None] = []  # the cached prefix each block holds, if any
        self.free_plain: list[int] = []  # free blocks holding no cached prefix: the last one is taken first
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # free blocks holding one: front evicted first
        self.cached: dict[bytes, int] = {}
        self.free_host: list[int] = list(range(num_host_blocks))
        self.watermark_blocks = max(1, int(watermark * num_blocks)) if watermark > 0 else 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached) + self.num_blocks - len(self.ref_counts)

    @property
    def num_used_blocks(self) -> int:
        """Block ids below this have been handed out at least once; the never-used ones follow, taken in id order."""
        return len(self.ref_counts)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache -------------------------------------------------------------------------------------

    def match_prefix(self, req: Request) -> list[int]:
        """Cached blocks holding the longest prefix of the request's tokens (always leaving one token to compute)."""
        if not self.enable_prefix_caching:
            return []
        bs, tokens = self.block_size, req.token_ids
        if len(req.block_hashes) < len(tokens) // bs:
            req.block_hashes = prefix_block_hashes(tokens, bs, req.block_hashes)
        usable = (len(tokens) - 1) // bs
        cached = self.cached
        hits: list[int] = []
        for key in islice(req.block_hashes, usable):
            block_id = cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def mark_computed(self, req: Request, num_computed_tokens: int) -> None:
        """The request's KV now covers its first `num_computed_tokens` tokens: its newly full blocks are registered in
        the prefix cache."""
        req.num_computed_tokens = num_computed_tokens
        if req.num_draft_computed > num_computed_tokens:  # the draft's KV past a rejected proposal is not valid
            req.num_draft_computed = num_computed_tokens
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, num_full = req.num_cached_blocks, num_computed_tokens // bs
        if num_full <= first:  # no block filled since the last call (most decode steps)
            return
        keys = req.block_hashes
        if len(keys) < num_full:  # keys are a function of the tokens, which only grow: keep known ones
            keys = req.block_hashes = prefix_block_hashes(req.token_ids[: num_full * bs], bs, keys)
        block_keys, cached, table = self.keys, self.cached, req.block_table
        for i in range(first, num_full):
            block_id, key = table[i], keys[i]
            if block_keys[block_id] is None and key not in cached:  # else another block holds this prefix already
                block_keys[block_id] = key
                cached[key] = block_id
        req.num_cached_blocks = num_full

    # --- prefixes computed elsewhere (disaggregated prefill: engine/kv_exchange.py) --------------------------

    def cached_prefix_length(self, keys: Iterable[bytes]) -> int:
        """How many leading blocks of a prompt with these keys the prefix cache holds."""
        count, cached = 0, self.cached
        for key in keys:
            if key not in cached:
                break
            count += 1
        return count

    def adopt(self, key: bytes) -> int | None:
        """A block to hold a prefix block computed elsewhere under `key`: taken like a fresh one, registered in the
        prefix cache and left free (no request owns it), the most recently used of the cached blocks. None when a
        block holds that prefix already, or no block is free. The caller fills the block before the next step."""
        if not self.enable_prefix_caching or not self.num_free_blocks:
            return None
        held = self.cached.get(key)
        if held is not None:
            if held in self.free_cached:
                self.free_cached.move_to_end(held)  # used again: evicted last
            return None
        block_id = self._take_free()
        self.keys[block_id] = key
        self.cached[key] = block_id
        self._release([block_id])
        return block_id

    # --- allocation ---------------------------------------------------------------------------------------

    def admission_cost(self, req: Request, hits: list[int], num_new_tokens: int) -> int:
        """Free blocks that admitting the request with these prefix hits and this first chunk would consume."""
        ref_counts = self.ref_counts
        revived = [ref_counts[b] for b in hits].count(0)
        fresh = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        return revived + fresh

    def can_admit(self, cost: int) -> bool:
        return self.num_free_blocks - cost >= self.watermark_blocks

    def allocate(self, req: Request, max_new_tokens: int) -> int:
        """Admits a request that holds no blocks: its cached prefix, then up to `max_new_tokens` tokens more. Returns
        the tokens it has to compute now; 0, allocating nothing, when that would leave fewer free blocks than the
        watermark."""
        hits = self.match_prefix(req)
        num_new_tokens = min(req.num_tokens - len(hits) * self.block_size, max_new_tokens)
        if not self.can_admit(self.admission_cost(req, hits, num_new_tokens)):
            return 0
        self.admit(req, hits, num_new_tokens)
        return num_new_tokens

    def admit(self, req: Request, hits: list[int], num_new_tokens: int) -> None:
        self._ref(hits)
        req.block_table = list(hits)
        # a cached block holds the draft model's KV too (speculative decoding with a draft shares block tables)
        req.num_computed_tokens = req.num_draft_computed = len(hits) * self.block_size
        req.num_cached_blocks = len(hits)
        self.grow(req, num_new_tokens)

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_table))

    def grow(self, req: Request, num_new_tokens: int) -> None:
        for _ in range(self.blocks_needed(req, num_new_tokens)):
            req.block_table.append(self._take_free())

    def take_blocks(self, reqs: Iterable[Request]) -> None:
        """One fresh block at the end of each request's table, in order (what grow does for a request whose next
        token starts a block)."""
        take = self._take_free
        for req in reqs:
            req.block_table.append(take())

    def free_request(self, req: Request) -> None:
        """Drops the request's references; blocks keep their cached contents, the tail ones are evicted first."""
        self._release(req.block_table)
        req.block_table = []
        req.num_cached_blocks = 0

    def trim(self, req: Request) -> None:
        """Gives back the blocks at the end of the request's table that hold none of its computed tokens (the slots
        of rejected speculative proposals)."""
        keep = self.blocks_for(req.num_computed_tokens)
        if len(req.block_table) > keep:
            self._release(req.block_table[keep:])
            del req.block_table[keep:]

    def _release(self, block_ids: list[int]) -> None:
        """Drops one reference to each block, last first; a block no one owns any more becomes free."""
        ref_counts, keys, plain, cached = self.ref_counts, self.keys, self.free_plain, self.free_cached
        for block_id in reversed(block_ids):
            count = ref_counts[block_id] - 1
            ref_counts[block_id] = count
            if not count:
                if keys[block_id] is None:
                    plain.append(block_id)  # nothing worth keeping: reused first (the table's head first)
                else:
                    cached[block_id] = None

    def _take_free(self) -> int:
        """A fresh block, owned once: taken in the order the module's docstring gives, its cached prefix evicted."""
        ref_counts = self.ref_counts
        if self.free_plain:
            block_id = self.free_plain.pop()
            ref_counts[block_id] = 1
            return block_id
        block_id = len(ref_counts)
        if block_id < self.num_blocks:  # the next block never used yet
            ref_counts.append(1)
            self.keys.append(None)
            return block_id
        block_id, _ = self.free_cached.popitem(last=False)
        key = self.keys[block_id]
        if key is None:  # free_request queues only blocks holding a cached prefix in free_cached
            raise RuntimeError(f"KV block {block_id} is in free_cached but holds no cached prefix")
        if self.cached.get(key) == block_id:
            del self.cached[key]
        self.keys[block_id], ref_counts[block_id] = None, 1
        return block_id

    def _ref(self, block_ids: list[int]) -> None:
        ref_counts, free = self.ref_counts, self.free_cached
        for block_id in block_ids:
            if not ref_counts[block_id]:  # a hit on a free block: only those holding a cached prefix are hits
                del free[block_id]
            ref_counts[block_id] += 1

    # --- swap space ---------------------------------------------------------------------------------------

    def can_swap_out(self, req: Request) -> bool:
        return len(self.free_host) >= len(req.block_table)

    def swap_out(self, req: Request) -> list[tuple[int, int]]:
        """Moves the request's blocks to host memory; returns (device block, host block) copies to perform."""
        host_blocks = [self.free_host.pop() for _ in req.block_table]
        copies = list(zip(req.block_table, host_blocks))
        self.free_request(req)
        req.block_table = host_blocks
        return copies

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        """Brings a swapped request's blocks back; returns (host block, device block) copies to perform."""
        copies = []
        for host_block in req.block_table:
            copies.append((host_block, self._take_free()))
        self.free_host.extend(req.block_table)
        req.block_table = [device for _, device in copies]
        return copies

    def free_swapped(self, req: Request) -> None:
        self.free_host.extend(req.block_table)
        req.block_table = []
