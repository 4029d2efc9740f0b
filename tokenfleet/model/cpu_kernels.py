"""The C++ paged decode-attention kernel for CPUs, compiled on first use (cached by torch per machine).

Set TOKENFLEET_CPU_KERNELS=0 to use the pure-PyTorch path instead; if compiling fails (no compiler, no ninja)
the engine logs why and falls back to that path too.
"""
from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"


@cache
def paged_decode_attention_op():
    """The compiled op, or None when disabled or unavailable."""
    if os.environ.get("TOKENFLEET_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(
            name="tokenfleet_cpu_kernels", cpp_sources=[SOURCE.read_text()], functions=["paged_decode_attention"],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"], verbose=False)
    except Exception as e:  # a missing compiler must not stop the engine
        log.warning("CPU attention kernel unavailable, using the PyTorch path: %s", e)
        return None
    return module.paged_decode_attention
