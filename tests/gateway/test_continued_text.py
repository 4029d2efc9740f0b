"""The text of a continued response, from its token ids: whichever token the hand-over falls on, the text the client
got before it and the continuation's text after it add up to the text of one uninterrupted engine request, also when
the dead replica still held back part of a UTF-8 character or the start of a stop string."""

from __future__ import annotations

import pytest

from tokenfleet.gateway.continued_text import ContinuedText
from tokenfleet.model.tokenizer import StopStringMatcher, Tokenizer

TEXT = "price: 5 € or 7 ¥, naïve café; the end"


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(demo_model_dir)


def engine_text(tokenizer: Tokenizer, prompt: list[int], ids: list[int], stop: list[str]) -> tuple[list[str], str]:
    """The text deltas one engine request sends for `ids` (each token alone, as the engine steps), and its end."""
    matcher = StopStringMatcher.for_request(tokenizer, prompt, stop)
    deltas = []
    for token in ids:
        delta, matched = matcher.add([token])
        deltas.append(delta)
        if matched is not None:
            return deltas, ""
    return deltas, matcher.flush()


@pytest.mark.parametrize("stop", [[], ["7 ¥"], ["é;"]])
def test_every_hand_over_point_gives_the_uninterrupted_text(tokenizer, stop):
    prompt = tokenizer.encode("Tell me the prices.")
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    deltas, tail = engine_text(tokenizer, prompt, ids, stop)
    expected = "".join(deltas) + tail
    assert "€" in expected or stop, "the tokenizer splits the characters into bytes: held-back text is tested"
    for cut in range(len(deltas)):
        sent = "".join(deltas[:cut])
        text = ContinuedText.after(tokenizer, prompt, {"stop": stop, "ignore_eos": True}, ids[:cut], sent)
        continued, finish = text.add(ids[cut : len(deltas)], "length" if not stop else None)
        assert sent + continued == expected, f"hand-over after token {cut}"
        assert finish == ("stop" if stop else "length")


def test_a_stop_token_adds_no_text(tokenizer):
    prompt = tokenizer.encode("Hi")
    ids = tokenizer.encode("def fn(x): return x", add_special_tokens=False)
    body = {"stop_token_ids": [ids[-1]]}
    deltas, _ = engine_text(tokenizer, prompt, ids[:2], [])
    text = ContinuedText.after(tokenizer, prompt, body, ids[:2], "".join(deltas))
    continued, finish = text.add(ids[2:], "stop")
    assert "".join(deltas) + continued == tokenizer.decode(ids[:-1]) and finish == "stop"


def test_a_replica_with_another_tokenizer_is_not_replayed(tokenizer):
    ids = tokenizer.encode("hello there", add_special_tokens=False)
    assert ContinuedText.after(tokenizer, [1], {}, ids, "something else") is None
