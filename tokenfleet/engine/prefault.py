"""CachePrefaulter: the pages of a CPU KV cache are faulted in while the engine is idle, ahead of the blocks the
allocator hands out.

A CPU cache is lazily committed memory (runner.device_cache): the kernel allocates and zeroes a page at its first
write. The block manager hands out never-used blocks before it evicts a cached prefix, so the written frontier
keeps moving into fresh memory until the whole cache is resident; each time it enters a new 2 MiB huge page of
every (layer, K/V, KV head) slab at once, the step writing there waits for the kernel. On the demo model served at
2 req/s that was 60-90 ms every ~1,000 blocks, against 15-30 ms for the prefill itself, and it set TTFT p99. Doing
it beside a step does not help: on the 2-core VM it was measured on, a thread faulting pages in slowed a matmul
on the other core 3x. So a thread faults the next `ahead` blocks in while no step runs, one slab's piece at a time
(a request arriving waits for one piece at most), with MADV_POPULATE_WRITE, which never changes a byte. Resident
memory grows with use, `ahead` blocks past the highest block handed out so far.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence

import torch

from tokenfleet.model.cpu_kernels import HUGE_PAGE, populate_for_write

log = logging.getLogger(__name__)
IDLE_S = 0.02  # no step for this long: the engine is idle (a busy engine steps every few milliseconds)


class CachePrefaulter:
    def __init__(self, caches: Sequence[torch.Tensor], num_blocks: int, ahead_blocks: int) -> None:
        """`caches`: contiguous tensors of [..., num_blocks, block elements], one slab of blocks per leading index."""
        self.caches = list(caches)
        self.num_blocks = num_blocks
        self.ahead = max(1, min(num_blocks, ahead_blocks))
        self.ready = 0  # blocks [0, ready) of every slab are faulted in
        self.target = 0  # ... and [ready, target) are to be
        self.enabled = all(c.device.type == "cpu" and c.is_contiguous() and c.shape[-2] == num_blocks for c in caches)
        self._chunk = max(1, min(HUGE_PAGE // _block_bytes(c) for c in self.caches)) if self.caches else 1
        self._last_step = 0.0
        self._lock = threading.Lock()
        self._working = False
        self._move_target(0)

    def keep_ahead_of(self, used_blocks: int) -> None:
        """Called at every step with how many blocks have been handed out at least once (ids below it)."""
        self._last_step = time.monotonic()
        if used_blocks + self.ahead // 2 > self.target:
            self._move_target(used_blocks)

    def wait(self, timeout_s: float = 60.0) -> bool:
        """True once the blocks asked for are in (tests)."""
        deadline = time.monotonic() + timeout_s
        while self.ready < self.target and self.enabled and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.ready >= self.target

    def _move_target(self, used_blocks: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.target = max(self.target, min(self.num_blocks, used_blocks + self.ahead))
            if self._working or self.ready >= self.target:
                return
            self._working = True
        # the thread holds the prefaulter only while it faults a piece in: an engine dropped stops it
        threading.Thread(target=_work, args=(weakref.ref(self),), name="tokenfleet-kv-prefault", daemon=True).start()

    def _next_piece(self) -> tuple[int, int] | None:
        """The next blocks to fault in, or None (and the thread ends) when there are none."""
        with self._lock:
            if not self.enabled or self.ready >= self.target:
                self._working = False
                return None
            return self.ready, min(self.target, self.ready + self._chunk)

    def _idle_for(self) -> float:
        return time.monotonic() - self._last_step

    def _fault_in(self, first: int, end: int) -> bool:
        """Blocks [first, end) of one slab after another, each only while the engine is idle; False if the kernel
        cannot (before Linux 5.14)."""
        for cache in self.caches:
            block_bytes = _block_bytes(cache)
            slab_bytes = self.num_blocks * block_bytes
            for slab in range(cache.numel() * cache.element_size() // slab_bytes):
                while (idle := self._idle_for()) < IDLE_S:
                    time.sleep(IDLE_S - idle)
                if not populate_for_write(
                    cache.data_ptr() + slab * slab_bytes + first * block_bytes, (end - first) * block_bytes
                ):
                    return False
        return True


def _work(ref: weakref.ref[CachePrefaulter]) -> None:
    while (prefaulter := ref()) is not None and (piece := prefaulter._next_piece()) is not None:
        if prefaulter._fault_in(*piece):
            prefaulter.ready = piece[1]
        else:
            log.info("KV cache pages are faulted in by the steps that first write them (no MADV_POPULATE_WRITE)")
            prefaulter.enabled, prefaulter._working = False, False
        del prefaulter


def _block_bytes(cache: torch.Tensor) -> int:
    return cache.shape[-1] * cache.element_size()
