"""Start real server processes for tests, and wait for them to be healthy."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the test process dies, even by SIGKILL (the OOM killer, a CI
    timeout), so no server outlives its test run holding memory and ports."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@contextmanager
def running_process(args: list[str], health_url: str, log_path: Path, timeout: float = 120.0):
    """Runs `python -m tokenfleet ARGS` until the block ends; fails fast with the log if it dies or never answers."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=_die_with_parent,
        )
    try:
        wait_healthy(proc, health_url, log_path, timeout)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not healthy after {timeout}s:\n{log_path.read_text()[-3000:]}")


def wait_idle(base: str, timeout: float = 10.0) -> dict:
    """Polls a server's /load until nothing runs or waits (or the timeout passes); returns the last report."""
    deadline = time.monotonic() + timeout
    while True:
        load = httpx.get(f"{base}/load").json()
        if (load["running"] == 0 and load["waiting"] == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def metric(base: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples at `base`/metrics whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def abandon_stream(client, model: str, max_tokens: int, after_chunks: int = 3) -> None:
    """Starts a long streamed chat completion with the openai SDK, reads a few chunks, then hangs up."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Go"}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i + 1 == after_chunks:
            break
    stream.close()


def delete_redis_keys(prefix: str, url: str = "redis://127.0.0.1:6379") -> None:
    """Removes every Redis key a test created under its own prefix."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found
