"""Property: whatever JSON (or not-JSON) a client throws at a real `tokenfleet serve`'s chat and completions routes,
the answer is never a 5xx, every 4xx is OpenAI's error shape, a 200 never hides a server error or a failed
generation, and the server stays healthy."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.chaos.conftest import CHAT, MODEL, TEXT, VOCAB, assert_openai_error

DEEP = "__deep__"  # a placeholder string, replaced by JSON nested this deep in the encoded body

INTERESTING_INTS = [
    0,
    1,
    -1,
    2,
    129,
    511,
    512,
    VOCAB - 1,
    VOCAB,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63),
    -(2**63) - 1,
    10**30,
    -(10**30),
]
lone_surrogates = st.sampled_from(["\ud800", "\udfff", "x\ud83d", "\udc00y", "\ud83d\ud83d"])
hostile_text = st.one_of(st.text(max_size=20), lone_surrogates, st.sampled_from(["", "\x00", "²", "１", "😀" * 3]))
hostile_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(INTERESTING_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-50, 1e-320, 5e-324, 1e308, -0.0]),
    hostile_text,
    st.integers(60, 3000).map(lambda depth: f"{DEEP}{depth}"),
)
hostile_values = st.recursive(
    hostile_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(hostile_text, children, max_size=3),
    max_leaves=8,
)
# n and max_tokens: hostile, yet cheap when valid (a few tokens, a few choices)
small_counts = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([v for v in INTERESTING_INTS if not 3 < v < 600]),
    st.sampled_from([None, True, "2", 2.0, 2.5, -0.0, 1e308, float("nan"), float("inf"), [2], {"n": 2}]),
)

CHAT_FIELDS = [
    "model",
    "messages",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "min_tokens",
    "ignore_eos",
    "stream",
    "stream_options",
    "priority",
    "user",
    "add_generation_prompt",
]
TEXT_FIELDS = [
    "model",
    "prompt",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "min_tokens",
    "ignore_eos",
    "stream",
    "stream_options",
    "priority",
    "echo",
    "suffix",
]
COUNT_FIELDS = ["max_tokens", "max_completion_tokens", "n"]

messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "tool"]), hostile_text),
            "content": st.one_of(hostile_text, hostile_values),
        }
    ),
    min_size=0,
    max_size=3,
)
prompts = st.one_of(
    hostile_text,
    st.lists(hostile_text, max_size=3),
    st.lists(st.one_of(st.integers(0, VOCAB - 1), st.sampled_from(INTERESTING_INTS)), max_size=5),
    st.lists(st.lists(st.sampled_from(INTERESTING_INTS), min_size=1, max_size=3), max_size=3),
)


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    """(path, raw body): a valid request with some fields made hostile, or something that is barely a request."""
    path = draw(st.sampled_from([CHAT, TEXT]))
    shape = draw(st.sampled_from(["fields", "fields", "fields", "any json", "bytes"]))
    if shape == "bytes":
        return path, draw(
            st.one_of(
                st.binary(max_size=40),
                st.sampled_from(
                    [b"", b"{", b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', b"\xef\xbb\xbf{}", b"[]" * 3, b"null"]
                ),
            )
        )
    if shape == "any json":
        return path, encode(draw(hostile_values), draw(st.booleans()))
    body = (
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        if path == CHAT
        else {"model": MODEL, "prompt": "Hi"}
    )
    body |= {"max_tokens": 2, "temperature": 0}
    fields = CHAT_FIELDS if path == CHAT else TEXT_FIELDS
    for name in draw(st.lists(st.sampled_from(fields + COUNT_FIELDS), min_size=1, max_size=4, unique=True)):
        if name in COUNT_FIELDS:
            body[name] = draw(small_counts)
        elif name == "messages":
            body[name] = draw(st.one_of(messages, hostile_values))
        elif name == "prompt":
            body[name] = draw(st.one_of(prompts, hostile_values))
        else:
            body[name] = draw(hostile_values)
    return path, encode(body, draw(st.booleans()))


def encode(value: object, ascii_only: bool) -> bytes:
    """JSON as a careless client writes it: NaN and Infinity allowed; lone surrogates as escapes (\\ud800) or as
    raw UTF-8-encoded bytes (ED A0 80); placeholders swapped for deep nesting."""
    text = json.dumps(value, allow_nan=True, ensure_ascii=ascii_only)
    while (at := text.find(f'"{DEEP}')) >= 0:
        end = text.index('"', at + 1)
        depth = int(text[at + len(DEEP) + 1 : end])
        text = text[:at] + "[" * depth + "]" * depth + text[end + 1 :]
    return text.encode("utf-8", "surrogatepass")


def check_success(response: httpx.Response) -> None:
    """A 200 is a real answer: no server error inside the stream, no choice that failed."""
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        chunks = [json.loads(data) for data in events[:-1]]
        assert not [c for c in chunks if "error" in c], response.text[-500:]
    else:
        chunks = [response.json()]
    reasons = [choice.get("finish_reason") for c in chunks for choice in c.get("choices", [])]
    assert "error" not in reasons, response.text[-500:]


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=bodies())
def test_hostile_bodies_never_break_the_server(serve, case):
    path, content = case
    response = httpx.post(f"{serve}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code < 500, (content[:300], response.text[:500])
    if response.status_code >= 400:
        assert_openai_error(response, response.status_code)
    else:
        assert response.status_code == 200, response.text[:500]
        check_success(response)
    assert httpx.get(f"{serve}/health", timeout=10).status_code == 200
