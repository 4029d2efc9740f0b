"""How much host memory a CPU engine's KV cache and swap space take, and why: sized to the job (max_num_seqs
sequences of max_model_len tokens), within a share of the memory available once the model is loaded. Explicit
kv_cache_gib / swap_space_gib win. Both are anonymous memory that the kernel commits page by page as blocks are
first written, so a lightly used server stays small whatever its budget."""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from math import ceil, prod
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GIB = 1 << 30
KV_SHARE_OF_AVAILABLE = 0.25  # an automatic KV cache takes at most this share of the available memory
SWAP_SHARE_OF_AVAILABLE = 0.125  # automatic swap space: at most this share (and no larger than the KV cache)
# GPU memory outside PyTorch's allocator: the CUDA context, cuBLAS workspaces, NCCL buffers (vLLM counts it too)
CUDA_CONTEXT_BYTES = 1 * GIB


@dataclass(frozen=True)
class Job:
    """What the engine will be asked to hold at most, and what one block of it costs."""

    max_num_seqs: int
    max_model_len: int
    block_size: int
    block_bytes: int
    watermark: float

    def blocks_needed(self) -> int:
        """Blocks for every sequence at full length, plus the watermark kept free at admission."""
        per_sequence = -(-self.max_model_len // self.block_size)
        return ceil(self.max_num_seqs * per_sequence / max(0.5, 1.0 - self.watermark))


@dataclass(frozen=True)
class MemoryPlan:
    num_blocks: int
    num_host_blocks: int
    kv_reason: str  # why the KV cache has this size, for the start-up log
    swap_reason: str


def plan_cpu_memory(
    job: Job, kv_cache_gib: float | None, swap_space_gib: float | None, available_bytes: int
) -> MemoryPlan:
    """The KV cache: kv_cache_gib when given, else what the job needs, within KV_SHARE_OF_AVAILABLE of the
    available memory. The swap space: swap_space_gib when given, else as large as the KV cache, within
    SWAP_SHARE_OF_AVAILABLE."""
    needed = job.blocks_needed()
    if kv_cache_gib is not None:
        num_blocks = int(kv_cache_gib * GIB // job.block_bytes)
        kv_reason = f"kv_cache_gib={kv_cache_gib:g} as set"
    else:
        cap = int(KV_SHARE_OF_AVAILABLE * available_bytes // job.block_bytes)
        num_blocks = min(needed, cap)
        job_text = f"max_num_seqs {job.max_num_seqs} x max_model_len {job.max_model_len:,}"
        share = f"{KV_SHARE_OF_AVAILABLE:.0%} of {available_bytes / GIB:.1f} GiB available"
        if num_blocks == needed:
            kv_reason = f"what {job_text} can use (within {share})"
        else:
            kv_reason = (
                f"capped at {share}: {job_text} could use {needed * job.block_bytes / GIB:.2f} GiB "
                "(set kv_cache_gib, or lower max_num_seqs or max_model_len)"
            )
    if swap_space_gib is not None:
        num_host_blocks = int(swap_space_gib * GIB // job.block_bytes)
        swap_reason = f"swap_space_gib={swap_space_gib:g} as set"
    else:
        cap = int(SWAP_SHARE_OF_AVAILABLE * available_bytes // job.block_bytes)
        num_host_blocks = min(num_blocks, cap)
        swap_reason = (
            "as large as the KV cache"
            if num_host_blocks == num_blocks
            else f"capped at {SWAP_SHARE_OF_AVAILABLE:.1%} of {available_bytes / GIB:.1f} GiB available"
        )
    return MemoryPlan(num_blocks, num_host_blocks, kv_reason, swap_reason)


@dataclass(frozen=True)
class GpuMemory:
    """One GPU as the engine finds it before allocating its KV cache."""

    total_bytes: int
    free_bytes: int
    engine_bytes: int  # this engine's weights (and draft's) plus its activations' peak, not other engines'


def plan_gpu_memory(
    gpu: GpuMemory, block_bytes: int, utilization: float, kv_cache_gib: float | None, swap_space_gib: float | None
) -> MemoryPlan:
    """vLLM's meaning of gpu_memory_utilization: this engine may use that fraction of the device in all, so its KV
    cache gets the fraction less the engine's own weights and activations (two engines at 0.4 share one GPU).
    kv_cache_gib, when given, wins. Either way the cache must fit in what is free now, or start-up fails saying
    so rather than failing at the first allocation."""
    if kv_cache_gib is not None:
        budget, kv_reason = kv_cache_gib * GIB, f"kv_cache_gib={kv_cache_gib:g} as set"
    else:
        budget = utilization * gpu.total_bytes - gpu.engine_bytes
        kv_reason = (
            f"gpu_memory_utilization={utilization:g} of {gpu.total_bytes / GIB:.1f} GiB "
            f"less {gpu.engine_bytes / GIB:.2f} GiB of weights and activations"
        )
    if budget > gpu.free_bytes:
        raise ValueError(
            f"the KV cache would take {budget / GIB:.2f} GiB ({kv_reason}) but only "
            f"{gpu.free_bytes / GIB:.2f} GiB of the GPU is free; lower gpu_memory_utilization or kv_cache_gib"
        )
    swap_gib = 1.0 if swap_space_gib is None else swap_space_gib
    return MemoryPlan(
        int(max(budget, 0) // block_bytes),
        int(swap_gib * GIB // block_bytes),
        kv_reason,
        f"swap_space_gib={swap_gib:g}",
    )


def available_memory() -> int:
    """Bytes this process could still take: the kernel's MemAvailable, or less under a cgroup memory limit."""
    available = _meminfo_available()
    limit = _cgroup_headroom()
    return min(available, limit) if limit is not None else available


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_headroom() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), None without a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        return None


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit


def keep_freed_heap() -> bool:
    """Tells glibc's malloc to keep freed memory for reuse instead of handing it back to the kernel: a CPU forward
    pass allocates and frees megabytes of activations per layer, and by default each such buffer is a fresh
    mmap whose pages fault in one by one on first write (a 2,048-token prefill step of the demo model spent ~19 %
    of its time so; vLLM's CPU docs preload tcmalloc for the same reason). The process keeps its peak heap.
    False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(
        mallopt(param, value) == 1
        for param, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))
    )


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor in private anonymous memory: pages are committed when first written, so the
    resident size grows with use, not with the budget (torch.zeros would write every page up front)."""
    import torch

    num_bytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE)
    # torch.frombuffer holds the buffer (and so the mapping) for as long as the tensor lives
    return torch.frombuffer(memory, dtype=torch.uint8, count=num_bytes).view(dtype).view(shape)
