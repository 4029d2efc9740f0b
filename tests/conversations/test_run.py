"""A reply's events as the conversation stream sends them."""

from __future__ import annotations

import json

from tokenfleet.conversations.run import Run
from tokenfleet.gateway.resume import StreamEvent


def test_streamed_text_is_the_text_that_is_saved():
    """A byte-level tokenizer can produce "\\x00"; the store keeps it as U+FFFD, so the stream sends the same, and
    a client's text matches what a refresh shows."""
    run = Run("msg_1", "conv_1", relay=None, prefix="so far ")
    for delta in ("a\x00b", "\x00", "c"):
        run.apply(StreamEvent(1, json.dumps({"delta": delta}), None))
    streamed = "".join(json.loads(e.data)["text"] for e in run.events if e.event == "token")
    assert streamed == "a\ufffdb\ufffdc"
    assert run.content == "so far a\ufffdb\ufffdc"
