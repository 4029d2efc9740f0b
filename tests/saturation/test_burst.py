"""A burst on `tokenfleet serve`: the gateway lets in what the engine can run (its max_num_seqs), so a request's
first token does not wait at the gateway while the engine has room; the replica's load report counts the prompt
tokens it prefilled, which the overload ladder measures its prefill rate by."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.servers import free_port, running_process

BURST = 80  # more than the 64 dispatch slots a replica used to get, fewer than its engine's max_num_seqs


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["serve", "--model", str(demo_model_dir), "--port", str(port), "--served-model-name", "tiny"]
    args += ["--max-num-seqs", "96", "--max-model-len", "1024", "--data-dir", str(logs / "data")]
    with running_process(args, f"{base}/health", logs / "serve.log"):
        yield base


async def stream_one(client: httpx.AsyncClient, base: str, n: int, started: asyncio.Event) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"{n} Tell me a long story, number {n}"}],  # no prefix hits
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for _ in response.aiter_lines():
            if started.is_set():
                break


async def most_in_engine(base: str, until: float) -> int:
    """The most requests the engine held at once (running or waiting) while the burst was on."""
    most = 0
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < until:
            load = (await client.get(f"{base}/load")).json()
            most = max(most, load["running"] + load["waiting"])
            if most >= BURST:
                break
            await asyncio.sleep(0.05)
    return most


def test_every_request_of_a_burst_reaches_the_engine_when_it_has_room(server):
    async def burst() -> int:
        done = asyncio.Event()
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
            streams = [asyncio.create_task(stream_one(client, server, n, done)) for n in range(BURST)]
            most = await most_in_engine(server, time.monotonic() + 30)
            done.set()
            await asyncio.gather(*streams)
        return most

    assert asyncio.run(burst()) == BURST, "requests waited at the gateway while the engine had room"
    load = httpx.get(f"{server}/load").json()
    assert load["prefill_tokens_total"] >= BURST * 10, "the load report counts the prompt tokens prefilled"
