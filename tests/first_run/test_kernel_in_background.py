"""A first start does not wait for the compiler (issue 23 point 1): where this environment has no CPU attention
kernel built yet, `tokenfleet serve` answers on the PyTorch decode path while the kernel compiles in the background,
then switches to it between two steps, saying both; greedy outputs are the same on either path.

The compiler here is a wrapper that holds every compile until the test opens a gate, so that "the first answer came
before the build finished" is a fact of the test, not a race against the machine's speed."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.servers import free_port, running_process
from tokenfleet.model import cpu_kernels

SMALL = ["--kv-cache-gib", "0.05", "--swap-space-gib", "0.01", "--max-model-len", "512"]
ON_PYTORCH = "decoding on the PyTorch path until it is ready"
SWITCHED = "CPU attention kernel loaded: decode attention uses it from this step on"
# named g++ so that PyTorch takes it for GCC; version queries pass, compiles (-c) wait for the gate (10 min at most)
GATED_COMPILER = """#!/bin/sh
case " $* " in
  *" -c "*) waited=0; while [ ! -e '{gate}' ] && [ $waited -lt 6000 ]; do sleep 0.1; waited=$((waited + 1)); done ;;
esac
exec c++ "$@"
"""


def gated_compiler(folder: Path, gate: Path) -> Path:
    folder.mkdir()
    compiler = folder / "g++"
    compiler.write_text(GATED_COMPILER.format(gate=gate))
    compiler.chmod(0o755)
    return compiler


def greedy(base: str) -> str:
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_serve_answers_while_the_kernel_compiles_then_switches_to_it(demo_model_dir, tmp_path, monkeypatch):
    gate = tmp_path / "gate-open"
    monkeypatch.setenv("CXX", str(gated_compiler(tmp_path / "bin", gate)))
    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.delenv("TOKENFLEET_CPU_KERNELS", raising=False)
    built = cpu_kernels.kernel_dir() / cpu_kernels.DONE_MARK  # the server's folder: same environment and source
    port, log = free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    args = ["serve", "--model", str(demo_model_dir), "--port", str(port), "--served-model-name", "m", *SMALL]
    args += ["--data-dir", str(tmp_path / "data")]
    try:
        with running_process(args, f"{base}/health", log, timeout=300):
            on_pytorch = greedy(base)
            assert not built.exists()
            text = log.read_text()
            assert ON_PYTORCH in text and "compiling the CPU attention kernel for this environment" in text
            assert SWITCHED not in text

            gate.touch()
            wait_for(built.exists, 600, "the kernel never finished building")
            # the engine switches at its next step boundary: the first request after the build may straddle it
            wait_for(lambda: greedy(base) is not None and SWITCHED in log.read_text(), 60, "never switched")
            on_kernel = greedy(base)
    finally:
        gate.touch()  # never leave a compile waiting
    assert "CPU attention kernel compiled in" in log.read_text()
    assert on_kernel == on_pytorch


def test_a_failed_background_build_keeps_serving_on_pytorch(demo_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.delenv("TOKENFLEET_CPU_KERNELS", raising=False)
    port, log = free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    args = ["serve", "--model", str(demo_model_dir), "--port", str(port), "--served-model-name", "m", *SMALL]
    args += ["--data-dir", str(tmp_path / "data")]
    with running_process(args, f"{base}/health", log, timeout=300):
        wait_for(lambda: "CPU attention kernel unavailable" in log.read_text(), 120, "the build never failed")
        assert greedy(base) and greedy(base)
    text = log.read_text()
    assert ON_PYTORCH in text and "using the PyTorch path" in text and SWITCHED not in text
