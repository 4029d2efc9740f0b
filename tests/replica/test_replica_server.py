"""A real `tokenfleet replica` process, driven by the official openai SDK and raw HTTP."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.servers import abandon_stream, free_port, metric, running_process, wait_idle

MODEL = "tiny"


@pytest.fixture(scope="module")
def replica(demo_model_dir, tmp_path_factory):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [
        "replica",
        "--model",
        str(demo_model_dir),
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--kv-cache-gib",
        "0.05",
        "--swap-space-gib",
        "0.01",
        "--max-model-len",
        "512",
    ]
    with running_process(args, f"{base}/health", tmp_path_factory.mktemp("logs") / "replica.log"):
        yield base


@pytest.fixture
def client(replica):
    return openai.OpenAI(base_url=f"{replica}/v1", api_key="unused", max_retries=0)


def test_chat_non_streaming(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].finish_reason == "length" and resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens == 8 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8


def test_chat_streaming_with_usage_and_cache(client):
    messages = [{"role": "system", "content": "You answer in English. " * 8}, {"role": "user", "content": "Hi"}]
    kwargs = dict(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    first = list(client.chat.completions.create(**kwargs))
    second = list(client.chat.completions.create(**kwargs))
    for chunks in (first, second):
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    text = lambda chunks: "".join(c.choices[0].delta.content or "" for c in chunks[:-1])  # noqa: E731
    assert text(first) == text(second)
    assert second[-1].usage.prompt_tokens_details.cached_tokens >= 16  # the shared prefix hit the cache


def test_completions_n_stop_logprobs_and_token_prompts(client):
    resp = client.completions.create(
        model=MODEL,
        prompt=[5, 6, 7, 8],
        max_tokens=5,
        n=3,
        temperature=0.8,
        seed=3,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.completion_tokens == 15 and resp.usage.prompt_tokens == 4
    assert all(len(c.logprobs.tokens) == 5 and len(c.logprobs.top_logprobs[0]) == 2 for c in resp.choices)
    assert len({c.text for c in resp.choices}) > 1, "seeded choices must not all be the same sample"
    again = client.completions.create(
        model=MODEL, prompt=[5, 6, 7, 8], max_tokens=5, n=3, temperature=0.8, seed=3, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in again.choices] == [c.text for c in sorted(resp.choices, key=lambda c: c.index)]
    greedy = (
        client.completions.create(
            model=MODEL, prompt="The list", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = greedy[2:5]
    cut = client.completions.create(
        model=MODEL, prompt="The list", max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == greedy[: greedy.index(stop)]


def test_token_ids_beside_the_text_on_request(client):
    """vLLM's return_token_ids: what the gateway continues a response from when its replica dies; a prompt of the
    prompt's and the first tokens' ids continues greedily with exactly the rest."""
    kwargs = dict(
        model=MODEL,
        prompt=[5, 6, 7, 8],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = list(client.completions.create(**kwargs, stream=True))
    ids = [token for c in chunks for token in c.choices[0].token_ids]
    whole = client.completions.create(**kwargs)
    assert len(ids) == 12 and whole.choices[0].token_ids == ids
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    rest = client.completions.create(**{**kwargs, "prompt": [5, 6, 7, 8] + ids[:5], "max_tokens": 7})
    assert rest.choices[0].token_ids == ids[5:]
    plain = client.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True}})
    assert "token_ids" not in plain.choices[0].model_extra, "only when asked"


def test_closing_a_stream_frees_the_replica(client, replica):
    aborted = metric(replica, "vllm:request_success_total", finished_reason="abort")
    abandon_stream(client, MODEL, max_tokens=400, after_chunks=4)
    load = wait_idle(replica)
    assert load["running"] == 0 and load["waiting"] == 0 and load["kv_usage"] == 0.0
    assert metric(replica, "vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_async_client_concurrent(replica):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{replica}/v1", api_key="unused", max_retries=0)
        results = await asyncio.gather(
            *(
                client.completions.create(
                    model=MODEL, prompt=f"Number {i}", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
                )
                for i in range(6)
            )
        )
        assert all(r.usage.completion_tokens == 7 for r in results)
        await client.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    "kwargs,error,param",
    [
        (dict(messages=[]), openai.BadRequestError, "messages"),
        (dict(messages=[{"role": "user", "content": "x"}], max_tokens=0), openai.BadRequestError, "max_tokens"),
        (dict(messages=[{"role": "user", "content": "x"}], max_tokens=5000), openai.BadRequestError, "messages"),
        (dict(messages=[{"role": "user", "content": "x"}], temperature=3.5), openai.BadRequestError, "temperature"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), openai.BadRequestError, "messages.0.role"),
        (dict(messages=[{"role": "user", "content": "x"}], model="nope"), openai.NotFoundError, "model"),
    ],
)
def test_bad_input_gets_openai_errors(client, kwargs, error, param):
    with pytest.raises(error) as info:
        client.chat.completions.create(**{"model": MODEL, **kwargs})
    body = info.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error" and body["message"]


def test_raw_bad_requests(replica):
    bad_json = httpx.post(
        f"{replica}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    wrong_type = httpx.post(f"{replica}/v1/completions", json={"model": MODEL, "prompt": 5})
    assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"].startswith("prompt")
    huge = httpx.post(
        f"{replica}/v1/completions", content=b"x" * (5 << 20), headers={"content-type": "application/json"}
    )
    assert huge.status_code == 413
    assert httpx.get(f"{replica}/health").status_code == 200  # still serving


def test_models_metrics_and_load(replica):
    models = httpx.get(f"{replica}/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    metrics = httpx.get(f"{replica}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        'tokenfleet:engine_step_seconds_total{model_name="tiny",phase="forward"}',
        "tokenfleet:kv_cache_tokens",
    ):
        assert name in metrics, name
    load = httpx.get(f"{replica}/load").json()
    assert set(load) >= {"running", "waiting", "queued_prefill_tokens", "kv_usage", "kv_cache_tokens"}
    assert f'tokenfleet:kv_cache_tokens{{model_name="tiny"}} {float(load["kv_cache_tokens"])}' in metrics
