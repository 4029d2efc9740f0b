"""How a replica serves one chat request beyond its text: the tool-call format its template writes (and the
grammar that forces a call), whether the template thinks and where the output starts, and from these the parser
each choice's output goes through."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenfleet.api.chat_output import ChatOutput
from tokenfleet.api.errors import bad_request
from tokenfleet.api.protocol import ChatCompletionRequest
from tokenfleet.api.reasoning import ReasoningSplitter, Start, grammar_prefix, start_from_prompt, template_thinks
from tokenfleet.api.tool_parsers import format_for_template
from tokenfleet.api.tool_parsers.format import ToolFormat
from tokenfleet.api.tool_parsers.grammar import CallsGrammar
from tokenfleet.api.tools import ToolRequest, tools_error
from tokenfleet.engine.request import SamplingParams, StructuredOutput
from tokenfleet.engine.structured import GrammarError, check_structured_output
from tokenfleet.model.tokenizer import Tokenizer

PROMPT_TAIL_TOKENS = 8  # enough to see a think tag the generation prompt opened or closed


@dataclass(frozen=True)
class ChatPlan:
    tools: ToolRequest | None = None  # None: no tools, or tool_choice none (the output is all content)
    tool_format: ToolFormat | None = None
    reasoning_start: Start | None = None  # None: the template does not think
    grammar: StructuredOutput | None = None  # a forced call's
    keep_special_tokens: bool = False

    @property
    def parses(self) -> bool:
        """Whether the output's text goes through a parser (else it is all content, as it comes)."""
        return self.reasoning_start is not None or (self.tools is not None and self.tool_format is not None)

    def output(self) -> ChatOutput:
        """A parser for one choice's output."""
        reasoning = ReasoningSplitter(self.reasoning_start) if self.reasoning_start is not None else None
        parser = None
        if self.tools is not None and self.tool_format is not None:
            parser = self.tool_format.parser(self.tools.names, self.tools.max_calls)
        return ChatOutput(reasoning, parser)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        if self.grammar is None and not self.keep_special_tokens:
            return params
        return dataclasses.replace(
            params,
            structured_output=self.grammar or params.structured_output,
            skip_special_tokens=not self.keep_special_tokens,
        )


def plan_chat(req: ChatCompletionRequest, tokenizer: Tokenizer | None, prompt: list[int]) -> ChatPlan:
    """A 400 naming the field when the request asks for tools this model's template cannot serve."""
    tools = req.tool_request()
    if tokenizer is None:
        return ChatPlan()
    reasoning_start = _reasoning_start(tokenizer, prompt)
    if tools is None or tools.choice == "none":
        return ChatPlan(reasoning_start=reasoning_start)
    tool_format = format_for_template(tokenizer.template_source(with_tools=True))
    if tool_format is None:
        raise bad_request(
            "tools: this model's chat template does not write tool calls in a format this server parses "
            "(Llama 3 JSON, Hermes <tool_call> as in Qwen, Mistral [TOOL_CALLS])",
            param="tools",
            code="unsupported_parameter",
        )
    grammar = _forced_call_grammar(tools, tool_format, tokenizer, reasoning_start) if tools.forced else None
    return ChatPlan(tools, tool_format, reasoning_start, grammar, tool_format.keeps_special_tokens(tokenizer))


def _reasoning_start(tokenizer: Tokenizer, prompt: list[int]) -> Start | None:
    if not template_thinks(tokenizer.chat_template):
        return None
    return start_from_prompt(tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))


def _forced_call_grammar(
    tools: ToolRequest, tool_format: ToolFormat, tokenizer: Tokenizer, reasoning_start: Start | None
) -> StructuredOutput:
    prefix, rules = grammar_prefix(reasoning_start) if reasoning_start is not None else ("", "")
    calls = CallsGrammar(tools.callable, tools.parallel, prefix, rules)
    spec = StructuredOutput.grammar(tool_format.grammar(calls, tokenizer))
    try:
        check_structured_output(spec)
    except GrammarError as e:
        raise tools_error(e) from None
    return spec
