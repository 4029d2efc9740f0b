"""`tokenfleet serve` as a new user starts it (issue 23 points 1, 2 and 8): on a fresh home it writes the demo
checkpoint, says how much memory it took for the KV cache and the swap space and why, prints its data folder, and
answers; the whole server stays within 1 GiB of resident memory. Two serves on one machine each keep their own
database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.servers import free_port, running_process
from tokenfleet.model.cpu_kernels import kernel_cache_root

GIB = 1 << 30


def fresh_home_env(home: Path) -> dict[str, str]:
    """A new user's environment: an empty home, nothing of ours set; only the kernel build is shared with the rest
    of the suite (tests/first_run/test_kernel_build.py covers a first build)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENFLEET_", "XDG_"))}
    return {**env, "HOME": str(home), "TOKENFLEET_KERNEL_CACHE": str(kernel_cache_root())}


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants (the server and its engine process)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        status = Path(f"/proc/{current}/status").read_text()
        total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
        for task in Path(f"/proc/{current}/task").iterdir():
            pending += [int(child) for child in (task / "children").read_text().split()]
    return total


def chat(base: str, model: str, max_tokens: int = 16) -> dict:
    reply = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_first_serve_on_a_fresh_home_says_what_it_does_and_stays_small(tmp_path, monkeypatch):
    for name, value in fresh_home_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    for name in [n for n in os.environ if n.startswith(("TOKENFLEET_", "XDG_")) and n != "TOKENFLEET_KERNEL_CACHE"]:
        monkeypatch.delenv(name)
    port = free_port()
    log = tmp_path / "serve.log"
    with running_process(["serve", "--port", str(port)], f"http://127.0.0.1:{port}/health", log, timeout=300) as proc:
        for _ in range(5):
            assert chat(f"http://127.0.0.1:{port}", "demo-model")["usage"]["completion_tokens"] > 0
        rss = tree_rss(proc.pid)
    text = log.read_text()
    demo = tmp_path / ".cache" / "tokenfleet" / "demo-model"
    assert f"writing the demo checkpoint to {demo}" in text and (demo / "model.safetensors").is_file()
    assert "KV cache: " in text and "what max_num_seqs 256 x max_model_len 2,048 can use (within 25% of" in text
    assert "swap space: " in text and "(as large as the KV cache), allocated at the first swap-out" in text
    data_dir = tmp_path / ".local" / "share" / "tokenfleet" / f"serve-{port}"
    assert f"data dir: {data_dir} (--data-dir to choose)" in text and (data_dir / "tokenfleet.db").is_file()
    assert rss <= GIB, f"the demo server holds {rss / 2**20:.0f} MiB"


def usage_models(data_dir: Path, home: Path) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-m", "tokenfleet", "usage", "--by", "model", "--json", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env=fresh_home_env(home),
    )
    assert done.returncode == 0, done.stderr
    return {line["model"] for line in json.loads(done.stdout)}


def serve_args(model_dir: Path, port: int, name: str, *extra: str) -> list[str]:
    small = ["--kv-cache-gib", "0.05", "--max-model-len", "512"]
    return ["serve", "--model", str(model_dir), "--port", str(port), "--served-model-name", name, *small, *extra]


def test_two_serves_on_one_machine_keep_their_own_databases(demo_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("TOKENFLEET_DATABASE_URL", raising=False)
    first, second = free_port(), free_port()
    chosen = tmp_path / "chosen"
    with (
        running_process(
            serve_args(demo_model_dir, first, "alpha"), f"http://127.0.0.1:{first}/health", tmp_path / "a.log"
        ),
        running_process(
            serve_args(demo_model_dir, second, "beta", "--data-dir", str(chosen)),
            f"http://127.0.0.1:{second}/health",
            tmp_path / "b.log",
        ),
    ):
        chat(f"http://127.0.0.1:{first}", "alpha", 4)
        chat(f"http://127.0.0.1:{second}", "beta", 4)
        default_dir = tmp_path / ".local" / "share" / "tokenfleet" / f"serve-{first}"
        deadline = time.monotonic() + 30
        while not (usage_models(default_dir, tmp_path) and usage_models(chosen, tmp_path)):
            assert time.monotonic() < deadline, "usage never reached the warehouse"
            time.sleep(0.5)
        assert usage_models(default_dir, tmp_path) == {"alpha"}
        assert usage_models(chosen, tmp_path) == {"beta"}
    assert f"data dir: {chosen}" in (tmp_path / "b.log").read_text()
