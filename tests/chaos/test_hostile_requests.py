"""Hostile requests to real servers (`tokenfleet serve` and a replica): each gets OpenAI's 400 naming what is wrong,
never a 5xx or a failed generation, and never hurts anyone else's requests."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest

from tests.chaos.conftest import CHAT, MODEL, TEXT, VOCAB, assert_openai_error, post, post_raw


def chat_body(content: str = "x", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 3, **fields}


def text_body(prompt: object = "x", **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 3, **fields}


# --- 1: sampling parameters that broke the model step for everyone in it --------------------------------------------


def test_a_tiny_top_p_fails_nobody(server):
    """top_p=1e-50 used to fail the whole step: the request itself and every other tenant's request in it."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    neighbours = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Tell me about {topic}"}],
            max_tokens=300,
            temperature=0.7,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for i, topic in enumerate(["rivers", "bridges", "owls"])
    ]
    streams = [iter(stream) for stream in neighbours]
    for stream in streams:
        next(stream)  # each is generating when the poisoned request joins the batch
    endings = {}
    for top_p in (1e-50, 1e-320):
        poisoned = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=3,
            top_p=top_p,
            extra_body={"ignore_eos": True},
        )
        endings[f"top_p={top_p}"] = [poisoned.choices[0].finish_reason] * poisoned.usage.completion_tokens
    for i, stream in enumerate(streams):
        endings[f"neighbour {i}"] = [
            c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason
        ]
    assert endings == {
        "top_p=1e-50": ["length"] * 3,
        "top_p=1e-320": ["length"] * 3,
        "neighbour 0": ["length"],
        "neighbour 1": ["length"],
        "neighbour 2": ["length"],
    }


# --- 2: lone surrogates -------------------------------------------------------------------------------------------

SURROGATE_BODIES = {
    "chat content \\ud800": (
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
        "messages",
    ),
    "chat content x\\ud83d": (
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x\\ud83d"}]}',
        "messages",
    ),
    "completion prompt \\udc00": (TEXT, b'{"model": "tiny", "prompt": "\\udc00", "max_tokens": 3}', "prompt"),
    "completion prompts x\\ud83d": (
        TEXT,
        b'{"model": "tiny", "prompt": ["ok", "x\\ud83d"], "max_tokens": 3}',
        "prompt",
    ),
    "stop string": (TEXT, b'{"model": "tiny", "prompt": "x", "stop": ["\\ud800"], "max_tokens": 3}', "stop"),
    "raw bytes ED A0 80": (TEXT, b'{"model": "tiny", "prompt": "x\xed\xa0\x80", "max_tokens": 3}', None),
    "raw bytes in chat": (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', None),
}


@pytest.mark.parametrize("case", list(SURROGATE_BODIES))
def test_lone_surrogates_are_invalid_text(server, case):
    path, content, param = SURROGATE_BODIES[case]
    assert_openai_error(post_raw(server, path, content), 400, param)


def test_lone_surrogates_on_the_native_route(serve):
    content = b'{"model": "tiny", "messages": [{"role": "user", "content": "x\\ud83d"}], "max_tokens": 3}'
    assert_openai_error(post_raw(serve, "/v1/generate", content), 400, "messages")


def test_a_valid_surrogate_pair_is_text(server):
    content = b'{"model": "tiny", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    response = post_raw(server, TEXT, content)
    assert response.status_code == 200, response.text


# --- 3: JSON nested deeper than anything reads it ------------------------------------------------------------------


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [65, 1000, 5000])
def test_deep_json_is_refused(server, depth):
    in_body = f'{{"model": "tiny", "prompt": "x", "max_tokens": 3, "extra": {nested(depth)}}}'
    in_content = f'{{"model": "tiny", "messages": [{{"role": "user", "content": {nested(depth)}}}]}}'
    for path, content in ((TEXT, in_body), (CHAT, in_content), (TEXT, nested(depth))):
        error = assert_openai_error(post_raw(server, path, content.encode()), 400)
        assert "nests JSON more than 64 levels" in error["message"]


def test_nesting_within_the_limit_still_works(server):
    content = f'{{"model": "tiny", "prompt": "x", "max_tokens": 2, "extra": {nested(60)}}}'
    assert post_raw(server, TEXT, content.encode()).status_code == 200


def test_deep_json_in_the_conversations_api(serve):
    response = post_raw(serve, "/v1/conversations", f'{{"title": {nested(3000)}}}'.encode())
    assert_openai_error(response, 400)
    conversation = httpx.post(f"{serve}/v1/conversations", json={"title": "chaos"}).json()["id"]
    response = httpx.patch(
        f"{serve}/v1/conversations/{conversation}", content=f'{{"title": {{"a": {nested(2000)}}}}}'.encode()
    )
    assert_openai_error(response, 400)
    forged = base64.urlsafe_b64encode(nested(5000).encode()).decode().rstrip("=")
    assert_openai_error(httpx.get(f"{serve}/v1/conversations", params={"cursor": forged}), 400, "cursor")


# --- 4: token ids out of range -------------------------------------------------------------------------------------

BAD_TOKEN_PROMPTS = {
    "2**63": [9223372036854775808],
    "10**30": [10**30],
    "[[2**64]]": [[2**64]],
    "negative": [5, -1],
    "negative in a batch": [[5], [6, -3]],
    "vocab size": [5, VOCAB],
    "past the vocab in a batch": [[5], [VOCAB + 10]],
}


@pytest.mark.parametrize("case", list(BAD_TOKEN_PROMPTS))
@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_out_of_range_name_the_prompt(server, case, stream):
    error = assert_openai_error(post(server, TEXT, text_body(BAD_TOKEN_PROMPTS[case], stream=stream)), 400, "prompt")
    assert "token id" in error["message"]


def test_out_of_range_stop_token_ids(server):
    assert_openai_error(post(server, TEXT, text_body(stop_token_ids=[2**64])), 400, "stop_token_ids.0")


def test_the_last_token_of_the_vocabulary_is_fine(server):
    assert post(server, TEXT, text_body([0, VOCAB - 1])).status_code == 200


# --- 5: seeds outside what a generator takes -----------------------------------------------------------------------

BAD_SEEDS = [2**64, 2**70, -(2**63) - 1]


@pytest.mark.parametrize("seed", BAD_SEEDS)
def test_seed_out_of_range_is_400(server, seed):
    for path, body in (
        (CHAT, chat_body(seed=seed)),
        (TEXT, text_body(seed=seed)),
        (TEXT, text_body(seed=seed, stream=True)),
        (CHAT, chat_body(seed=seed, stream=True)),
    ):
        assert_openai_error(post(server, path, body), 400, "seed")


def test_seed_out_of_range_on_a_conversation_message(serve):
    conversation = httpx.post(f"{serve}/v1/conversations", json={"title": "seeds"}).json()["id"]
    for seed in BAD_SEEDS:
        response = httpx.post(
            f"{serve}/v1/conversations/{conversation}/messages",
            json={"content": "hello", "seed": seed, "max_tokens": 3},
        )
        assert_openai_error(response, 400, "seed")


@pytest.mark.parametrize("seed", [-(2**63), 2**63, 2**64 - 1])
def test_seeds_at_the_edges_work_for_every_choice(server, seed):
    """The second choice's seed is seed + 1, past 2**64 - 1 for the last: the engine wraps it, never fails."""
    response = post(server, TEXT, text_body(seed=seed, n=2, temperature=1.0, ignore_eos=True))
    assert response.status_code == 200, response.text
    assert [c["finish_reason"] for c in response.json()["choices"]] == ["length", "length"]


# --- 6: Last-Event-ID that is not an ASCII number ------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_stream(serve) -> str:
    headers = {"x-tokenfleet-resumable": "true"}
    with httpx.stream(
        "POST", f"{serve}{CHAT}", json=chat_body(stream=True, ignore_eos=True), headers=headers
    ) as response:
        assert response.status_code == 200
        list(response.iter_lines())
        return response.headers["x-request-id"]


@pytest.mark.parametrize(
    "last",
    [b"\xb2", b"\xb9\xb2", b"9" * 5000, "１".encode(), b"-1", b"1e3", b"0x10"],
    ids=["superscript 2", "superscripts 12", "5000 nines", "fullwidth 1", "-1", "1e3", "hex"],
)
def test_bad_last_event_id_header(serve, finished_stream, last):
    response = httpx.get(f"{serve}/v1/requests/{finished_stream}/stream", headers={"Last-Event-ID": last}, timeout=10)
    assert_openai_error(response, 400, "Last-Event-ID")


@pytest.mark.parametrize(
    "query",
    ["%C2%B2", "%C2%B9%C2%B2", "9" * 5000, "%EF%BC%91"],
    ids=["superscript 2", "superscripts 12", "5000 nines", "fullwidth 1"],
)
def test_bad_last_event_id_query(serve, finished_stream, query):
    response = httpx.get(f"{serve}/v1/requests/{finished_stream}/stream?last_event_id={query}", timeout=10)
    assert_openai_error(response, 400, "Last-Event-ID")


def test_a_good_last_event_id_still_resumes(serve, finished_stream):
    response = httpx.get(f"{serve}/v1/requests/{finished_stream}/stream", headers={"Last-Event-ID": "3"}, timeout=10)
    assert response.status_code == 200
    ids = [int(line[4:]) for line in response.text.splitlines() if line.startswith("id: ")]
    assert ids and ids[0] == 4 and response.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("token", ["%C2%B2", "%ED%A0%80", "x" * 5000], ids=["superscript 2", "surrogate", "5000 x"])
def test_a_bad_resume_token_finds_no_stream(serve, finished_stream, token):
    response = httpx.get(f"{serve}/v1/requests/{finished_stream}/stream?resume_token={token}", timeout=10)
    assert_openai_error(response, 404, "request_id")
