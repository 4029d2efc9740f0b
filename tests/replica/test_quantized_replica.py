"""`tokenfleet replica --quantization int8`: the flag reaches the engine in its own process, which then generates
what the offline LLM with the same option generates, and differs from the unquantized model's output."""

from __future__ import annotations

import httpx
import pytest

from tests.checkpoints import SMALL_KV
from tests.servers import free_port, running_process
from tokenfleet import LLM, SamplingParams

PROMPTS = ["The river rose slowly", "A computer program is", "She opened the letter"]


def flat(rows: list[list[float]]) -> list[float]:
    return [value for row in rows for value in row]


def offline(model_dir, **options) -> tuple[list[str], list[list[float]]]:
    llm = LLM(str(model_dir), **SMALL_KV, **options)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params)
    return [out.text for out in outputs], [[lp.logprob for lp in out.logprobs] for out in outputs]


def test_replica_serves_the_quantized_model(demo_model_dir, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["replica", "--model", str(demo_model_dir), "--port", str(port), "--served-model-name", "q",
            "--quantization", "int8", "--kv-cache-gib", "0.02", "--swap-space-gib", "0.01",
            "--max-model-len", "256"]  # fmt: skip
    texts, logprobs = [], []
    with running_process(args, f"{base}/health", tmp_path / "replica.log"):
        for prompt in PROMPTS:
            body = {"model": "q", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            resp = httpx.post(f"{base}/v1/completions", json={**body, "logprobs": 1}, timeout=60)
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            texts.append(choice["text"])
            logprobs.append(choice["logprobs"]["token_logprobs"])
    assert "linear weights in 8 bits: online int" in (tmp_path / "replica.log").read_text()
    int8_texts, int8_logprobs = offline(demo_model_dir, quantization="int8")
    assert texts == int8_texts
    assert flat(logprobs) == pytest.approx(flat(int8_logprobs), abs=1e-4)
    _, full_logprobs = offline(demo_model_dir)  # the unquantized model: the same tokens, other probabilities
    assert max(abs(a - b) for a, b in zip(flat(logprobs), flat(full_logprobs))) > 1e-4


def test_replica_refuses_an_unknown_quantization(demo_model_dir, tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "tokenfleet", "replica", "--model", str(demo_model_dir), "--quantization", "int4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--quantization" in done.stderr and "int4" in done.stderr
