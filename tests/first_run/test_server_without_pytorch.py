"""The server process of `tokenfleet serve` and `tokenfleet replica` never loads PyTorch (issue 23 point 1: a later
start's time went largely into importing it twice): it talks to the engine process through a pipe, so it only
needs the engine's records (engine/outputs.py), not the model. Only the engine process maps libtorch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port, running_process
from tokenfleet.model.cpu_kernels import kernel_cache_root

HEAVY = ("torch", "transformers")
SMALL = ["--kv-cache-gib", "0.05", "--swap-space-gib", "0.01", "--max-model-len", "512"]
# what the server side of either command imports, up to the engine process's front door
SERVER_SIDE = """
import json, sys
import tokenfleet.cli, tokenfleet.commands.serve, tokenfleet.commands.replica, tokenfleet.replica.server
from tokenfleet.engine.engine_process import EngineProcess, start_engine
from tokenfleet.engine.outputs import RequestOutput
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def test_the_server_side_imports_no_pytorch():
    done = subprocess.run([sys.executable, "-c", SERVER_SIDE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert "tokenfleet" in loaded and loaded & set(HEAVY) == set()


def test_request_output_is_still_importable_from_the_engine_module():
    from tokenfleet.engine.engine import RequestOutput as FromEngine
    from tokenfleet.engine.outputs import RequestOutput

    assert FromEngine is RequestOutput


def children(pid: int) -> list[int]:
    return [
        int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()
    ]


def maps_libtorch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def exercise(base: str, model: str) -> None:
    """What makes a server touch the engine's records: a streamed chat, logprobs, a structured output."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as streamed:
        assert streamed.status_code == 200 and "[DONE]" in streamed.read().decode()
    reply = httpx.post(f"{base}/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["logprobs"]["content"], reply.text
    structured = {**chat, "max_tokens": 64, "response_format": {"type": "json_object"}}
    reply = httpx.post(f"{base}/v1/chat/completions", json=structured, timeout=60)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("command", ["serve", "replica", "serve on a fresh home"])
def test_the_server_process_maps_no_libtorch_only_its_engine_does(command, demo_model_dir, tmp_path, monkeypatch):
    port = free_port()
    args = [command, "--model", str(demo_model_dir), "--served-model-name", "m", *SMALL]
    if command == "serve":
        args += ["--data-dir", str(tmp_path / "data")]
    if command == "serve on a fresh home":  # the demo checkpoint is written first, which takes PyTorch
        monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(kernel_cache_root()))  # the suite's build, not a new one
        monkeypatch.setenv("HOME", str(tmp_path))
        args = ["serve", "--served-model-name", "m", *SMALL]
    base = f"http://127.0.0.1:{port}"
    with running_process(
        [*args, "--port", str(port)], f"{base}/health", tmp_path / "server.log", timeout=300
    ) as server:
        exercise(base, "m")
        engines = [pid for pid in children(server.pid) if maps_libtorch(pid)]
        assert not maps_libtorch(server.pid), f"the {command} server process loaded PyTorch"
        assert len(engines) == 1, "the engine process, and only it, maps libtorch"
    if command == "serve on a fresh home":
        assert "writing the demo checkpoint" in (tmp_path / "server.log").read_text()
