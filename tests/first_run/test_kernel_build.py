"""Start fast and say so (issue 23 point 1): the CPU attention kernel is built once per environment, in a folder of
its own per environment and PyTorch version, under a lock, with a log line saying what happens and how long it
usually takes; processes starting together build it once, and a later start only loads it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from tokenfleet.model import cpu_kernels

# loads the kernel the way the engine does, runs it once, and says what it got
PROBE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from tokenfleet.model.cpu_kernels import paged_decode_attention_op
op = paged_decode_attention_op()
q = torch.ones(1, 4, 16)
cache = torch.ones(2, 3, 16 * 16)
out = op(q, cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([5]), 16, 0.25)
print("op output", float(out.sum()))
"""


def probe(cache_dir, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PROBE],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TOKENFLEET_KERNEL_CACHE": str(cache_dir), "TOKENFLEET_CPU_KERNELS": "1", **env},
    )


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "op output 64.0" in out, out
    return out


def test_built_once_under_a_lock_then_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path))
    folder = cpu_kernels.kernel_dir()  # the folder the probes will use: same environment, torch and source
    assert folder.parent == tmp_path and folder.name.startswith(f"py311-torch{torch.__version__}-")
    folder.mkdir()
    (folder / "lock").write_text("")  # torch's own lock file, as a build killed midway leaves it

    first, second = probe(tmp_path), probe(tmp_path)
    outputs = [finish(first), finish(second)]
    compiled = [out for out in outputs if "compiling the CPU attention kernel for this environment" in out]
    assert len(compiled) == 1, outputs
    assert "usually 10-30 s" in compiled[0] and str(folder) in compiled[0]
    assert "CPU attention kernel compiled in" in compiled[0]
    assert (folder / "built").is_file() and (folder / "tokenfleet_cpu_kernels.so").is_file()

    started = time.monotonic()
    later = finish(probe(tmp_path))
    assert "compiling" not in later and "waiting" not in later, later
    assert time.monotonic() - started < 60


def test_each_environment_and_torch_version_has_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path))
    here = cpu_kernels.kernel_dir()
    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv")
    other_environment = cpu_kernels.kernel_dir()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    other_torch = cpu_kernels.kernel_dir()
    assert len({here, other_environment, other_torch}) == 3
    assert other_torch.name.startswith("py311-torch9.9.9-")
    monkeypatch.delenv("TOKENFLEET_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu_kernels.kernel_dir().parent == tmp_path / "xdg" / "tokenfleet" / "kernels"


def test_a_failed_build_falls_back_to_pytorch_with_the_reason(tmp_path):
    """No compiler on the PATH: the engine still starts, on the PyTorch path, and the log says why."""
    just_load = PROBE[: PROBE.index("q = ")] + "print('op', op)"
    proc = subprocess.run(
        [sys.executable, "-c", just_load],
        capture_output=True,
        text=True,
        env={**os.environ, "TOKENFLEET_KERNEL_CACHE": str(tmp_path), "CXX": "/nonexistent/c++"},
        timeout=300,
    )
    assert proc.returncode == 0 and "op None" in proc.stdout, proc.stdout + proc.stderr
    assert "CPU attention kernel unavailable, using the PyTorch path" in proc.stdout + proc.stderr
