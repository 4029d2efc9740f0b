"""The CPU KV cache's pages are faulted in while the engine is idle, ahead of the blocks in use, without touching a
byte of what the cache holds (engine/prefault.py). Residency is read with mincore(2)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import time

import pytest
import torch

from tokenfleet.engine import prefault
from tokenfleet.engine import runner as runner_module
from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.engine import Engine
from tokenfleet.engine.memory import lazily_zeroed
from tokenfleet.engine.prefault import CachePrefaulter
from tokenfleet.engine.request import SamplingParams
from tokenfleet.model.cpu_kernels import populate_for_write

PAGE = mmap.PAGESIZE
BLOCKS, BLOCK_ELEMS = 4096, 512  # float32: 2 KiB a block, 8 MiB a slab
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _can_populate() -> bool:
    probe = mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    return populate_for_write(address, PAGE)


pytestmark = pytest.mark.skipif(not _can_populate(), reason="this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")


def resident_fraction(address: int, length: int) -> float:
    start = address & ~(PAGE - 1)
    pages = (address + length - start + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * PAGE), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


def blocks_resident(cache: torch.Tensor, slab: int, first: int, end: int) -> float:
    block_bytes = cache.shape[-1] * cache.element_size()
    return resident_fraction(cache.data_ptr() + (slab * BLOCKS + first) * block_bytes, (end - first) * block_bytes)


def new_cache() -> torch.Tensor:
    return lazily_zeroed((2, 2, BLOCKS, BLOCK_ELEMS), torch.float32)  # 4 slabs


def test_the_blocks_ahead_are_faulted_in_and_not_the_rest():
    cache = new_cache()
    assert blocks_resident(cache, 0, 0, BLOCKS) == 0.0
    prefaulter = CachePrefaulter([cache], BLOCKS, ahead_blocks=1024)
    assert prefaulter.wait(30)
    for slab in range(4):
        assert blocks_resident(cache, slab, 0, 1024) == 1.0
        assert blocks_resident(cache, slab, 3072, BLOCKS) == 0.0  # beyond one huge page of rounding

    prefaulter.keep_ahead_of(1000)  # the margin is under half: the target moves to 1000 + 1024
    assert prefaulter.target == 2024
    assert prefaulter.wait(30)
    for slab in range(4):
        assert blocks_resident(cache, slab, 0, 2024) == 1.0


def test_faulting_in_never_changes_what_the_cache_holds():
    cache = new_cache()
    cache[1, 1, 5] = torch.arange(BLOCK_ELEMS, dtype=torch.float32)  # a block written before its page was faulted in
    prefaulter = CachePrefaulter([cache], BLOCKS, ahead_blocks=BLOCKS)
    assert prefaulter.wait(30)
    assert torch.equal(cache[1, 1, 5], torch.arange(BLOCK_ELEMS, dtype=torch.float32))
    assert torch.count_nonzero(cache).item() == BLOCK_ELEMS - 1  # the rest still reads as zeros


def test_nothing_is_faulted_in_while_the_engine_steps(monkeypatch):
    monkeypatch.setattr(prefault, "IDLE_S", 0.2)  # a loaded machine's late wake-up is not taken for idleness
    cache = new_cache()
    prefaulter = CachePrefaulter([cache], BLOCKS, ahead_blocks=512)
    assert prefaulter.wait(30)
    busy_until = time.monotonic() + 0.6
    while time.monotonic() < busy_until:
        prefaulter.keep_ahead_of(400)  # a step every 5 ms; target 912: the thread starts and waits for idleness
        last_step = time.monotonic()
        time.sleep(0.005)
        assert prefaulter.ready == 512
    assert blocks_resident(cache, 3, 1536, BLOCKS) == 0.0
    assert prefaulter.wait(30)  # idle now
    assert prefaulter.ready == 912
    assert time.monotonic() - last_step >= 0.2


def test_a_dropped_prefaulter_stops_its_thread():
    cache = new_cache()
    prefaulter = CachePrefaulter([cache], BLOCKS, ahead_blocks=BLOCKS)
    prefaulter.keep_ahead_of(0)  # busy: the thread waits
    del prefaulter
    time.sleep(0.2)  # it faults in at most the piece it holds, then finds the prefaulter gone
    assert blocks_resident(cache, 3, 3072, BLOCKS) == 0.0  # two pieces at most, and a huge page of rounding


def test_an_engine_keeps_its_cache_faulted_in_ahead_of_its_requests(demo_model_dir, monkeypatch):
    monkeypatch.setattr(runner_module, "PREFAULT_AHEAD_BYTES", 0)  # four steps' worth only: 4 x 2048 / 16 blocks
    engine = Engine(EngineConfig.from_options(str(demo_model_dir), kv_cache_gib=0.25, max_num_batched_tokens=2048))
    prefaulter = engine.runner.prefaulter
    assert prefaulter is not None and prefaulter.ahead == 512 < engine.runner.num_blocks
    assert prefaulter.wait(30) and prefaulter.ready == 512
    for i in range(6):  # 6 x 1,600 prompt tokens: 600 blocks handed out
        engine.add_request(list(range(i, i + 1600)), SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    used = engine.blocks.num_used_blocks
    assert used >= 600
    assert prefaulter.wait(30)
    assert prefaulter.ready >= used + 256
    cache = engine.runner.kv_cache
    block_bytes = cache.shape[-1] * cache.element_size()
    assert resident_fraction(cache.data_ptr(), prefaulter.ready * block_bytes) == 1.0  # the first slab
