"""Engine outputs rendered as OpenAI objects: chat.completion(.chunk) and text_completion, usage, logprobs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenfleet.api.usage import Usage
from tokenfleet.engine.request import TokenLogprob
from tokenfleet.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenfleet.engine.engine import RequestOutput


@dataclass
class Renderer:
    """Builds the response objects of one API request (all its choices)."""

    kind: str  # "chat" or "text"
    request_id: str
    model: str
    tokenizer: Tokenizer | None
    created: int = field(default_factory=lambda: int(time.time()))
    token_ids: bool = False  # vLLM's return_token_ids: every choice carries its generated token ids too

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def chunk(self, index: int, out: RequestOutput, first: bool) -> dict:
        """A streamed chunk carrying what one engine output added to choice `index`."""
        choice: dict = {"index": index, "logprobs": self.logprobs(out.new_logprobs), "finish_reason": None}
        if self.kind == "chat":
            choice["delta"] = {"role": "assistant", "content": out.new_text} if first else {"content": out.new_text}
        else:
            choice["text"] = out.new_text
        if out.finished:
            choice["finish_reason"] = out.finish_reason
        if self.token_ids:
            choice["token_ids"] = list(out.new_token_ids)
        return self._envelope(self.object_name + ("" if self.kind == "text" else ".chunk"), [choice])

    def usage_chunk(self, usage: Usage) -> dict:
        return {
            **self._envelope(self.object_name + ("" if self.kind == "text" else ".chunk"), []),
            "usage": usage.as_dict(),
        }

    def response(self, finals: list[RequestOutput], usage: Usage) -> dict:
        """The whole non-streamed response; finals[i] is choice i's final output."""
        choices = []
        for index, out in enumerate(finals):
            choice: dict = {"index": index, "logprobs": self.logprobs(out.logprobs), "finish_reason": out.finish_reason}
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text
            if self.token_ids:
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        return {**self._envelope(self.object_name, choices), "usage": usage.as_dict()}

    def logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not entries:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_entry(e) for e in entries]}
        return {
            "tokens": [self._token(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token(t): lp for t, lp in e.top} for e in entries],
        }

    def _chat_entry(self, entry: TokenLogprob) -> dict:
        token = self._token(entry.token_id)
        return {
            "token": token,
            "logprob": entry.logprob,
            "bytes": list(token.encode()),
            "top_logprobs": [
                {"token": (t := self._token(tid)), "logprob": lp, "bytes": list(t.encode())} for tid, lp in entry.top
            ],
        }

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
