"""The README is executed (issue 23 point 5): the shell blocks of its "Set up on a fresh machine" and "Serving"
sections run in order, as one bash script, on a fresh home and a fresh PostgreSQL database, so a step can never go
missing again.

What the script does with them, and nothing more: `pip install` (the suite runs in the installed project) and the
test commands (`ruff`, `mypy`, `pytest`: CI itself) are left out; a server command (`tokenfleet serve | fleet |
replica | gateway`, as one would start it in a terminal of its own) runs in the background, and the script waits for
its /health before the next line; a block that starts servers first stops those of the blocks before it (a new set
of terminals); a failing command fails the test (`set -e`; the README's curls use --fail-with-body). The fleet
blocks get a fresh database through $TOKENFLEET_DATABASE_URL, which every command honours, instead of the machine's
`tokenfleet` database. The ports are the README's own (8000, 8100-8102)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import delete_redis_keys
from tests.store.backends import database_url, drop_postgres_database
from tokenfleet.model.cpu_kernels import kernel_cache_root

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("## Set up on a fresh machine", "### Serving")
LEFT_OUT = ("pip install", "ruff ", "mypy", "python -m pytest")
SERVER = re.compile(r"^(?:\w+=\S+\s+)*tokenfleet (serve|fleet|replica|gateway)\b")
FLEET_WORDS = ("tokenfleet fleet", "tokenfleet gateway", "tokenfleet replica")
README_PORTS = (8000, 8100, 8101, 8102)

PRELUDE = """set -euo pipefail
stop_servers() {
  for pid in $(jobs -p); do kill -TERM "$pid" 2>/dev/null || true; done
  wait || true
}
trap stop_servers EXIT
wait_ready() {  # URL PID LOG: until the URL answers 200; the server's log if it dies first
  for _ in $(seq 1 3000); do
    if curl -sf -o /dev/null "$1"; then return 0; fi
    if ! kill -0 "$2" 2>/dev/null; then echo "server died:"; tail -n 60 "$3"; return 1; fi
    sleep 0.2
  done
  echo "no answer from $1"; tail -n 60 "$3"; return 1
}
"""


@dataclass
class Block:
    section: str
    commands: list[str]  # one shell command per entry, continuation lines joined


def readme_blocks(text: str) -> list[Block]:
    blocks, section = [], None
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("#"):
            section = next((s for s in SECTIONS if line.strip() == s), None)
        elif line.strip() == "```bash" and section:
            body = []
            for inner in lines:
                if inner.strip() == "```":
                    break
                body.append(inner)
            blocks.append(Block(section, commands("\n".join(body))))
    return blocks


def commands(body: str) -> list[str]:
    """Its commands: continuation lines joined, comments dropped (a trailing one too, so that what the script
    appends to a server command is not commented out)."""
    joined = re.sub(r"\\\n\s*", "", body)
    lines = [re.sub(r"\s+#\s.*$", "", line) for line in joined.splitlines()]
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def runnable(command: str) -> str | None:
    """The command without its left-out parts (None when nothing is left)."""
    parts = [p.strip() for p in command.split(" && ")]
    kept = [p for p in parts if not p.startswith(LEFT_OUT)]
    return " && ".join(kept) or None


def port_of(command: str) -> int:
    found = re.search(r"--port (\d+)", command)
    return int(found.group(1)) if found else 8000


def script(blocks: list[Block], database: str) -> str:
    out, fleet_started, server = [PRELUDE], False, 0
    for block in blocks:
        runs = [c for c in map(runnable, block.commands) if c]
        if any(SERVER.match(c) for c in runs):
            out.append("stop_servers")
        if not fleet_started and any(word in c for c in runs for word in FLEET_WORDS):
            out.append(f"export TOKENFLEET_DATABASE_URL={database}")
            fleet_started = True
        for command in runs:
            if SERVER.match(command):
                server += 1
                log = f"server-{server}.log"
                out.append(f"{command} > {log} 2>&1 &")
                out.append(f"wait_ready http://127.0.0.1:{port_of(command)}/health $! {log}")
            else:
                out.append(command)
    return "\n".join(out) + "\n"


def test_the_blocks_are_found_and_turned_into_a_script():
    blocks = readme_blocks((ROOT / "README.md").read_text())
    assert {b.section for b in blocks} == set(SECTIONS)
    text = script(blocks, "postgresql://x/y")
    assert "tokenfleet serve > server-1.log 2>&1 &" in text  # the quick start, without its pip install
    assert "pip install" not in text and "pytest" not in text
    assert "tokenfleet fleet --replicas 2 >" in text and "export TOKENFLEET_DATABASE_URL=postgresql://x/y" in text
    assert text.count("curl --fail-with-body") >= 4


def port_in_use(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_the_readme_runs_on_a_fresh_home_and_database(tmp_path):
    tokenfleet = Path(sys.executable).parent / "tokenfleet"
    if not tokenfleet.exists():
        pytest.fail(f"no {tokenfleet}: the README's commands need the installed project (pip install -e .)")
    busy = [port for port in README_PORTS if port_in_use(port)]
    if busy:
        pytest.fail(f"the README's ports {busy} are in use by another process on this machine")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    shutil.copytree(ROOT / "deploy", work / "deploy")  # the README's paths are relative to a checkout
    name = f"tftest_{uuid.uuid4().hex}"
    text = script(readme_blocks((ROOT / "README.md").read_text()), database_url(name))
    (tmp_path / "readme.sh").write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENFLEET_", "XDG_"))}
    env.update(
        HOME=str(home),
        PATH=f"{tokenfleet.parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
        TOKENFLEET_KERNEL_CACHE=str(kernel_cache_root()),  # a first build is tests/first_run/test_kernel_build.py's
    )
    try:
        done = subprocess.run(
            ["bash", str(tmp_path / "readme.sh")], cwd=work, env=env, capture_output=True, text=True, timeout=1800
        )
    finally:
        drop_postgres_database(name)
        delete_redis_keys(f"tokenfleet:{name}:")
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(work.glob("server-*.log")))
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}\n{logs}"
    assert done.stdout.count('"choices"') + done.stdout.count("data: {") >= 3, done.stdout[-4000:]
    assert '"key":' in done.stdout  # the admin API's new key
    assert (home / ".local" / "share" / "tokenfleet" / "serve-8000" / "tokenfleet.db").is_file()
    assert not any(port_in_use(port) for port in README_PORTS), "a server outlived the script"
