"""Engine outputs rendered as OpenAI objects: chat.completion(.chunk) and text_completion, usage, logprobs; a chat
choice's text goes through its ChatOutput (reasoning and tool calls parsed out) on the way."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenfleet.api.chat_output import ChatOutput, MessageDelta
from tokenfleet.api.chat_plan import ChatPlan
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
    plan: ChatPlan = field(default_factory=ChatPlan)
    outputs: dict[int, ChatOutput] = field(default_factory=dict)  # each chat choice's, fed as its text arrives

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def reasoning_tokens(self) -> int:
        return sum(output.reasoning_tokens for output in self.outputs.values())

    def follow(self, index: int, out: RequestOutput) -> MessageDelta:
        """What one engine output adds to chat choice `index`'s message."""
        output = self.outputs.get(index)
        if output is None:
            output = self.outputs[index] = self.plan.output()
        delta = output.feed(out.new_text, len(out.new_token_ids))
        if out.finished:
            delta.extend(output.finish())
        return delta

    def chunk(self, index: int, out: RequestOutput, first: bool) -> dict:
        """A streamed chunk carrying what one engine output added to choice `index`."""
        choice: dict = {"index": index, "logprobs": self.logprobs(out.new_logprobs), "finish_reason": None}
        if self.kind == "chat":
            choice["delta"] = self._delta(self.follow(index, out), first)
        else:
            choice["text"] = out.new_text
        if out.finished:
            choice["finish_reason"] = self._finish_reason(index, out.finish_reason)
        if self.token_ids:
            choice["token_ids"] = list(out.new_token_ids)
        return self._envelope(self.object_name + ("" if self.kind == "text" else ".chunk"), [choice])

    def _delta(self, delta: MessageDelta, first: bool) -> dict:
        out: dict = {"role": "assistant"} if first else {}
        # text a parser holds back (a tool call's or thinking's tag, maybe) makes an empty delta, as OpenAI's
        if delta.content or not (self.plan.parses or delta.reasoning or delta.tool_calls):
            out["content"] = delta.content
        if delta.reasoning:
            out["reasoning_content"] = delta.reasoning
        if delta.tool_calls:
            out["tool_calls"] = [call.as_dict() for call in delta.tool_calls]
        return out

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for a choice that stopped after calling."""
        output = self.outputs.get(index)
        if reason == "stop" and output is not None and output.tool_calls:
            return "tool_calls"
        return reason

    def usage_chunk(self, usage: Usage) -> dict:
        return {
            **self._envelope(self.object_name + ("" if self.kind == "text" else ".chunk"), []),
            "usage": usage.as_dict(),
        }

    def response(self, finals: list[RequestOutput], usage: Usage) -> dict:
        """The whole non-streamed response; finals[i] is choice i's final output."""
        choices = []
        for index, out in enumerate(finals):
            choice: dict = {
                "index": index,
                "logprobs": self.logprobs(out.logprobs),
                "finish_reason": self._finish_reason(index, out.finish_reason),
            }
            if self.kind == "chat":
                choice["message"] = self._message(index, out)
            else:
                choice["text"] = out.text
            if self.token_ids:
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        return {**self._envelope(self.object_name, choices), "usage": usage.as_dict()}

    def _message(self, index: int, out: RequestOutput) -> dict:
        output = self.outputs.get(index)
        if output is None:  # never fed (no output reached the renderer): the final text as it is
            output = self.outputs[index] = self.plan.output()
            output.feed(out.text, len(out.token_ids))
            output.finish()
        calls = output.tool_calls
        message: dict = {"role": "assistant", "content": output.content if output.content or not calls else None}
        if self.plan.reasoning_start is not None:
            message["reasoning_content"] = output.reasoning_text or None
        if calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        return message

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
