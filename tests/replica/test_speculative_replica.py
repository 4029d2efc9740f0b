"""`tokenfleet replica --speculative-config ...`: the flag reaches the engine in its own process; through the openai
SDK, greedy completions (whole and streamed, several tokens per event) are those of a replica without it, and
/metrics reports the acceptance counters under vLLM's names."""

from __future__ import annotations

import json
from contextlib import ExitStack

import openai

from tests.servers import free_port, metric, running_process

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 3,
    "one two three four, one two three four, one two three four,",
    "The river rose slowly",
]
SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})


def replica(stack: ExitStack, model_dir, logs, *extra: str) -> str:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["replica", "--model", str(model_dir), "--port", str(port), "--served-model-name", "m",
            "--kv-cache-gib", "0.02", "--swap-space-gib", "0.01", "--max-model-len", "512", *extra]  # fmt: skip
    stack.enter_context(running_process(args, f"{base}/health", logs / f"replica-{port}.log"))
    return base


def completions(base: str) -> tuple[list[str], list[str]]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    whole, streamed = [], []
    for prompt in PROMPTS:
        args = dict(model="m", prompt=prompt, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
        whole.append(client.completions.create(**args).choices[0].text)
        streamed.append("".join(chunk.choices[0].text for chunk in client.completions.create(**args, stream=True)))
    return whole, streamed


def test_speculative_replica_serves_the_same_greedy_output(demo_model_dir, tmp_path):
    with ExitStack() as stack:
        plain = replica(stack, demo_model_dir, tmp_path)
        spec = replica(stack, demo_model_dir, tmp_path, "--speculative-config", SPECULATIVE)
        expected, expected_streamed = completions(plain)
        got, got_streamed = completions(spec)
        assert got == expected and got_streamed == expected_streamed == expected
        drafts = metric(spec, "vllm:spec_decode_num_drafts_total", model_name="m")
        proposed = metric(spec, "vllm:spec_decode_num_draft_tokens_total", model_name="m")
        accepted = metric(spec, "vllm:spec_decode_num_accepted_tokens_total", model_name="m")
        per_position = metric(spec, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name="m")
        rate = metric(spec, "vllm:spec_decode_draft_acceptance_rate", model_name="m")
        assert drafts > 0 and 0 < accepted <= proposed and per_position == accepted
        assert abs(rate - accepted / proposed) < 1e-6
        assert metric(plain, "vllm:spec_decode_num_drafts_total") == 0  # absent without the flag
    assert "speculative decoding: ngram, k=4" in "".join(p.read_text() for p in tmp_path.glob("replica-*.log"))
