"""Fitting a conversation into the model's window with its real tokenizer and chat template: the system prompt and
the message being answered always stay, the newest earlier turns stay as far as room allows, whole turns go."""

from __future__ import annotations

import pytest

from tokenfleet.api.errors import APIError
from tokenfleet.conversations.prompt import fit, turns
from tokenfleet.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(demo_model_dir)


def history(n_turns: int) -> list[dict]:
    messages = []
    for i in range(n_turns):
        messages.append({"role": "user", "content": f"question number {i} about the weather in town {i}"})
        messages.append({"role": "assistant", "content": f"answer number {i}: it is sunny and warm in town {i}"})
    return messages


ASK = [{"role": "user", "content": "and tomorrow?"}]


def test_everything_fits_when_there_is_room(tokenizer):
    prompt = fit(tokenizer, 4096, 64, "You are terse.", history(3), ASK)
    assert prompt.dropped == 0
    assert prompt.messages == [{"role": "system", "content": "You are terse."}, *history(3), *ASK]
    assert prompt.token_ids == tokenizer.encode_chat(prompt.messages, add_generation_prompt=True)


def test_the_oldest_turns_go_and_the_system_prompt_and_newest_turns_stay(tokenizer):
    everything = history(40)
    window, max_tokens = 512, 100
    full = len(tokenizer.encode_chat([{"role": "system", "content": "S"}, *everything, *ASK]))
    assert full + max_tokens > window, "the test needs a history that does not fit"
    prompt = fit(tokenizer, window, max_tokens, "You are terse.", everything, ASK)
    kept = prompt.messages[1:-1]
    assert prompt.messages[0] == {"role": "system", "content": "You are terse."}
    assert prompt.messages[-1] == ASK[0]
    assert 0 < len(kept) < len(everything) and prompt.dropped == len(everything) - len(kept)
    assert kept == everything[-len(kept) :], "a suffix of the history: the newest turns"
    assert kept[0]["role"] == "user", "whole turns are dropped"
    assert prompt.tokens + max_tokens <= window
    # the largest suffix that fits: one more turn would not
    longer = [{"role": "system", "content": "You are terse."}, *everything[-len(kept) - 2 :], *ASK]
    assert len(tokenizer.encode_chat(longer, add_generation_prompt=True)) + max_tokens > window


@pytest.mark.parametrize("n_turns", [1, 2, 7, 40])
def test_the_fit_is_tight_for_any_history_length(tokenizer, n_turns):
    for window in (200, 300, 700):
        prompt = fit(tokenizer, window, 50, None, history(n_turns), ASK)
        assert prompt.tokens + 50 <= window
        if prompt.dropped:
            one_more = history(n_turns)[-(2 * n_turns - prompt.dropped) - 2 :]
            assert len(tokenizer.encode_chat([*one_more, *ASK], add_generation_prompt=True)) + 50 > window


def test_a_message_too_long_for_the_window_is_a_clear_400(tokenizer):
    with pytest.raises(APIError) as e:
        fit(tokenizer, 256, 64, "You are terse.", history(2), [{"role": "user", "content": "word " * 400}])
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert "256" in e.value.message and "max_tokens" in e.value.message


def test_a_continued_reply_ends_with_its_text_so_far(tokenizer):
    prompt = fit(tokenizer, 512, 50, "S", history(1), ASK, prefix="It will rain")
    head = tokenizer.encode_chat(prompt.messages, add_generation_prompt=True)
    assert prompt.token_ids[: len(head)] == head
    assert tokenizer.decode(prompt.token_ids[len(head) :]) == "It will rain"


def test_turns_start_at_user_messages():
    assert [len(t) for t in turns(history(3))] == [2, 2, 2]
    odd = [
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert [len(t) for t in turns(odd)] == [1, 2, 1]
