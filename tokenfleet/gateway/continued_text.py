"""The text of a response that moved to another replica mid-stream, made from its token ids the way the first
replica's engine made it. The new replica's detokenizer starts at the hand-over: it cannot know what the dead one
still held back (part of a UTF-8 character, the start of a possible stop string), nor see a stop string that began
before the hand-over. Replaying every generated id through the same detokenizer and stop matcher can."""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.model.tokenizer import StopStringMatcher, Tokenizer


class ContinuedText:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], body: dict) -> None:
        self.matcher = StopStringMatcher.for_request(tokenizer, prompt_ids, body.get("stop"))
        self.stop_token_ids = set(body.get("stop_token_ids") or ())
        if not body.get("ignore_eos"):
            self.stop_token_ids |= tokenizer.eos_token_ids

    @classmethod
    def after(
        cls, tokenizer: Tokenizer, prompt_ids: Sequence[int], body: dict, generated_ids: Sequence[int], sent_text: str
    ) -> ContinuedText | None:
        """The text's state once `generated_ids` are in; None when replaying them does not give back the text the
        client got (a replica with another tokenizer, say): the new replica's own text is then all there is."""
        text = cls(tokenizer, prompt_ids, body)
        replayed = "".join(text.matcher.add([token])[0] for token in generated_ids)
        return text if replayed == sent_text else None

    def add(self, token_ids: Sequence[int], finish_reason: str | None) -> tuple[str, str | None]:
        """The text that the new tokens complete, and the finish reason: "stop" as soon as a stop string completes,
        also one the replica did not see because it began before the hand-over."""
        text = ""
        for i, token in enumerate(token_ids):
            if finish_reason == "stop" and i == len(token_ids) - 1 and token in self.stop_token_ids:
                return text + self.matcher.flush(), "stop"  # a stop token adds no text (as in the engine)
            delta, matched = self.matcher.add([token])
            text += delta
            if matched is not None:
                return text, "stop"
        if finish_reason is not None:
            text += self.matcher.flush()
        return text, finish_reason
