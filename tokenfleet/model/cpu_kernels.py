"""The C++ paged decode-attention kernel for CPUs, compiled on first use (cached by torch per machine).

Set TOKENFLEET_CPU_KERNELS=0 to use the pure-PyTorch path instead; if compiling fails (no compiler, no ninja)
the engine logs why and falls back to that path too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


@cache
def paged_decode_attention_op():
    """The compiled op, or None when disabled or unavailable."""
    if os.environ.get("TOKENFLEET_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(
            name="tokenfleet_cpu_kernels",
            cpp_sources=[SOURCE.read_text()],  # the source binds its functions
            # fast-math lets GCC use vectorized expf in the softmax; the kernel only sees finite values
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            verbose=False,
        )
    except Exception as e:  # a missing compiler must not stop the engine
        log.warning("CPU attention kernel unavailable, using the PyTorch path: %s", e)
        return None
    return module.paged_decode_attention


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Asks Linux to back a large CPU tensor with transparent huge pages (fewer TLB misses when attention walks
    block tables scattered over a multi-GiB KV cache). Call before the memory is first written."""
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        aligned = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        if end - aligned < HUGE_PAGE:
            return False
        return libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(end - aligned), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False
