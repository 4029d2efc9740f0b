"""A new user's first run, measured: install time and size of `pip install -e .` in a fresh virtual environment,
time from `tokenfleet serve` to the first answer on a first start (demo checkpoint written, CPU kernel compiled in
the background: the first answers come on the PyTorch path) and on a later one, when the kernel was ready, and the
resident memory of the serving processes. Results: docs/benchmarks/first_run.md.

    python bench/first_run.py [--venv /tmp/fr-venv] [--skip-install] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CHAT = {"model": "demo-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}


def install(venv: Path) -> dict:
    shutil.rmtree(venv, ignore_errors=True)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-cache-dir", "-e", str(ROOT)]
    subprocess.run(pip, check=True)
    seconds = time.monotonic() - started
    size = int(subprocess.run(["du", "-sb", str(venv)], capture_output=True, text=True).stdout.split()[0])
    return {"install_s": round(seconds, 1), "venv_bytes": size}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_rss(pid: int) -> int:
    """Resident bytes of one process (the server's, without its engine process)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def kernel_built(home: Path) -> bool:
    return any((home / ".cache" / "tokenfleet" / "kernels").glob("*/built"))


def wait_for_kernel(home: Path, started: float, log: Path) -> float:
    """Seconds from the start until the background build was done (polled: at most this)."""
    while not kernel_built(home):
        if time.monotonic() - started > 900:
            raise RuntimeError(f"the CPU kernel was not built after 900 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return round(time.monotonic() - started, 1)


def serve_once(tokenfleet: Path, home: Path, log: Path) -> dict:
    """Starts `tokenfleet serve`, asks until the first answer, waits for the CPU kernel if it is still being built
    (so that a later start finds it), reads the memory, stops it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENFLEET_", "XDG_"))}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1")
    started = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(tokenfleet), "serve", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=30)
                if reply.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        first_answer_s = time.monotonic() - started
        result: dict = {"first_answer_s": round(first_answer_s, 1), "kernel_built_at_first_answer": kernel_built(home)}
        for _ in range(20):  # a few more requests, as a user trying it would send
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=30).raise_for_status()
        if not result["kernel_built_at_first_answer"]:
            result["kernel_built_s"] = wait_for_kernel(home, started, log)
            # one more answer: the engine switches to the kernel at its next step
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=30).raise_for_status()
        result["rss_bytes"], result["server_rss_bytes"] = tree_rss(proc.pid), process_rss(proc.pid)
        return result
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", default="/tmp/fr-venv")
    parser.add_argument("--skip-install", action="store_true", help="measure serve with the venv as it is")
    parser.add_argument("--later-starts", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    venv = Path(args.venv)
    results: dict = {"machine": {"cpus": os.cpu_count(), "load_1m": os.getloadavg()[0]}}
    if not args.skip_install:
        results["install"] = install(venv)
        print(results["install"], flush=True)
    with tempfile.TemporaryDirectory(prefix="first-run-home-") as home:
        log = Path(home) / "serve.log"
        results["first_start"] = serve_once(venv / "bin" / "tokenfleet", Path(home), log)
        print(results["first_start"], flush=True)
        results["later_starts"] = []
        for _ in range(args.later_starts):
            results["later_starts"].append(serve_once(venv / "bin" / "tokenfleet", Path(home), log))
            print(results["later_starts"][-1], flush=True)
        results["first_start_log"] = [
            line for line in log.read_text().splitlines()[:40] if " INFO " in line or "WARN" in line
        ]
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
