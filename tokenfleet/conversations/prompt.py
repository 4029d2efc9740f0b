"""The prompt for a reply, built by the server: the system prompt pinned first, then as many of the newest earlier
turns as fit, then the message being answered. Tokens are counted with the model's own tokenizer and chat
template, leaving room for max_tokens, by the same rule the gateway checks (prompt + max_tokens <= window).

The oldest turns are dropped whole (a user message with its reply), so the roles keep alternating as chat
templates expect. Dropped turns are not summarised: a summary costs a generation of its own on every long
conversation, and its quality is the model's; truncation is exact and free."""

from __future__ import annotations

from dataclasses import dataclass

import jinja2

from tokenfleet.api.errors import bad_request
from tokenfleet.model.tokenizer import Tokenizer


@dataclass
class Prompt:
    messages: list[dict]  # what a chat request sends: system, the kept history, the message being answered
    token_ids: list[int]  # the whole prompt as the model sees it, a continued reply's text included
    dropped: int  # earlier messages left out to fit

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


def turns(history: list[dict]) -> list[list[dict]]:
    """Messages grouped into turns, each starting at a user message."""
    groups: list[list[dict]] = []
    for m in history:
        if m["role"] == "user" or not groups:
            groups.append([m])
        else:
            groups[-1].append(m)
    return groups


def encode(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=True)
    except (ValueError, jinja2.TemplateError) as e:  # e.g. the template's raise_exception
        raise bad_request(f"the model's chat template refused this conversation: {e}", param="content") from e


def fit(
    tokenizer: Tokenizer,
    window: int,
    max_tokens: int,
    system: str | None,
    history: list[dict],
    tail: list[dict],
    prefix: str = "",
) -> Prompt:
    """`history`: earlier messages, oldest first, that may be dropped; `tail`: what must be sent (the message being
    answered); `prefix`: a reply's text so far, which the model continues (it follows the generation prompt)."""
    head = [{"role": "system", "content": system}] if system else []
    groups = turns(history)
    suffix = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
    budget = window - max_tokens

    def build(start: int) -> Prompt:
        kept = [m for group in groups[start:] for m in group]
        messages = head + kept + tail
        return Prompt(messages, encode(tokenizer, messages) + suffix, len(history) - len(kept))

    best = build(0)
    if best.tokens <= budget:
        return best
    best = build(len(groups))
    if best.tokens > budget:
        raise bad_request(
            f"this message needs {best.tokens} prompt tokens (with the system prompt"
            f"{' and the reply so far' if prefix else ''}) and {max_tokens} for the reply, more than "
            f"the model's context window of {window} tokens; shorten it or ask for fewer max_tokens",
            param="content",
            code="context_length_exceeded",
        )
    low, high = 1, len(groups)  # the smallest start that fits; fewer turns never take more tokens
    while low < high:
        middle = (low + high) // 2
        candidate = build(middle)
        if candidate.tokens <= budget:
            high, best = middle, candidate
        else:
            low = middle + 1
    return best  # always build(high)
