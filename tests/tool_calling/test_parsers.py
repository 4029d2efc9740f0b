"""The tool-call parsers on hand-written model outputs of each format (Hermes as Qwen writes it, Llama 3's JSON,
Mistral's [TOOL_CALLS] array and its v11 `[TOOL_CALLS]name[ARGS]{...}` calls), well formed and not: whatever the text and however it is cut into stream pieces, the
parser never raises, complete calls come out whole, and text that is not a complete call comes back as content.
Also the JSON scanner under them, the reasoning splitter and the two together as one chat choice's output."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from tokenfleet.api.chat_output import ChatOutput
from tokenfleet.api.reasoning import ReasoningSplitter, Start, start_from_prompt
from tokenfleet.api.tool_parsers import HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_V11, format_for_template
from tokenfleet.api.tool_parsers.format import ToolFormat
from tokenfleet.api.tool_parsers.json_scan import JsonScanner, JsonSyntaxError
from tokenfleet.api.tool_parsers.mistral import history_id
from tokenfleet.api.tool_parsers.pieces import CallArguments, CallDone, CallStart, Text

from .templates import LLAMA31, QWEN3, R1
from .templates import MISTRAL as MISTRAL_TEMPLATE
from .templates import MISTRAL_V11 as MISTRAL_V11_TEMPLATE

NAMES = ("get_weather", "get_time")
CHUNK_SIZES = (1, 2, 3, 7, 10_000)


@dataclass
class Parsed:
    content: str = ""
    calls: dict[int, list] = field(default_factory=dict)  # index -> [id, name, arguments, done]
    argument_pieces: int = 0

    @property
    def complete(self) -> list[tuple[str, dict]]:
        return [(name, json.loads(args)) for _, name, args, done in self.calls.values() if done]


def parse(fmt: ToolFormat, text: str, size: int = 1, max_calls: int | None = None) -> Parsed:
    parser, out = fmt.parser(NAMES, max_calls), Parsed()
    pieces = []
    for start in range(0, len(text), size):
        pieces += parser.feed(text[start : start + size])
    pieces += parser.finish()
    for piece in pieces:
        if isinstance(piece, Text):
            out.content += piece.text
        elif isinstance(piece, CallStart):
            assert piece.index == len(out.calls) and piece.index not in out.calls
            out.calls[piece.index] = [piece.id, piece.name, "", False]
        elif isinstance(piece, CallArguments):
            out.calls[piece.index][2] += piece.text
            out.argument_pieces += 1
        elif isinstance(piece, CallDone):
            out.calls[piece.index][3] = True
    return out


def parsed_every_way(fmt: ToolFormat, text: str, max_calls: int | None = None) -> Parsed:
    """Parsed in pieces of every size: the content and the complete calls never depend on where the cuts are."""
    results = [parse(fmt, text, size, max_calls) for size in CHUNK_SIZES]
    for other in results[1:]:
        assert (other.content, other.complete) == (results[0].content, results[0].complete)
    return results[0]


WEATHER = {"city": "Paris", "days": [1, 2.5e1], "metric": True, "note": 'say "hi"\\n\u00e9', "x": None}


def test_hermes_content_then_calls_in_any_key_order():
    text = (
        "Let me check.\n<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": WEATHER})
        + '\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>\n'
    )
    out = parsed_every_way(HERMES, text)
    assert out.content == "Let me check.\n"
    assert out.complete == [("get_weather", WEATHER), ("get_time", {})]
    assert all(call[0].startswith("call_") and len(call[0]) == 29 for call in out.calls.values())
    assert len({call[0] for call in out.calls.values()}) == 2
    assert parse(HERMES, text, 1).argument_pieces > 10  # arguments stream as they come


def test_hermes_call_without_its_closing_tag_at_the_end_is_still_a_call():
    out = parsed_every_way(HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_')
    assert out.complete == [("get_time", {"tz": "UTC"})] and out.content == ""


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',  # not JSON
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # half a call (max_tokens)
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not one of the tools
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>',  # arguments not an object
        "<tool_call>\nget_time()\n</tool_call>",  # not an object at all
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_cal> and then',  # a broken closing tag
        "<tool_call>",
        "<tool_ca",
        '<tool_call>\n{"name": "get_time", "arguments": {"a": 01}}',  # a number JSON does not allow
        '<tool_call>\n{"name": "get_time", "arguments": {"a": "\x01"}}',  # a raw control character
    ],
)
def test_hermes_text_that_is_not_a_whole_call_comes_back_as_content(text):
    out = parsed_every_way(HERMES, "Hi. " + text)
    assert out.complete == [] and out.content == "Hi. " + text
    assert all(not done for *_, done in out.calls.values())  # a stream may have started it; it never completes


def test_a_broken_call_after_a_whole_one_keeps_the_whole_one():
    good = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    out = parsed_every_way(HERMES, good + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "P')
    assert out.complete == [("get_time", {})]
    assert out.content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P'


def test_text_without_calls_is_all_content_and_held_back_only_while_it_could_be_a_trigger():
    for fmt, text in ((HERMES, "a <tool b <tool_c"), (MISTRAL, "a [TOOL b [TOOL_"), (LLAMA3_JSON, "  plain {x}")):
        assert parsed_every_way(fmt, text).content == text
    parser = HERMES.parser(NAMES)
    assert parser.feed("one <tool") == [Text("one ")]
    assert parser.feed("kit") == [Text("<toolkit")]


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = "\n".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>' for name in ("get_time", "get_weather")
    )
    out = parsed_every_way(HERMES, text, max_calls=1)
    assert out.complete == [("get_time", {})] and out.content == ""


def test_mistral_array_of_calls_with_the_special_token():
    calls = [{"name": "get_weather", "arguments": WEATHER}, {"name": "get_time", "arguments": {"tz": "CET"}}]
    out = parsed_every_way(MISTRAL, "[TOOL_CALLS] " + json.dumps(calls))
    assert out.complete == [("get_weather", WEATHER), ("get_time", {"tz": "CET"})] and out.content == ""
    assert all(len(call[0]) == 9 and call[0].isalnum() for call in out.calls.values())
    broken = parsed_every_way(MISTRAL, 'ok [TOOL_CALLS][{"name": "get_time", "arguments": {}} {"name"')
    assert broken.complete == [("get_time", {})] and broken.content == 'ok  {"name"'
    assert parsed_every_way(MISTRAL, "[TOOL_CALLS] []").content == "[TOOL_CALLS] []"


def v11(name: str, arguments: dict | str) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]" + (arguments if isinstance(arguments, str) else json.dumps(arguments))


def test_mistral_v11_calls_one_after_the_other_stream_as_openai_deltas():
    text = "Checking both. " + v11("get_weather", WEATHER) + v11("get_time", {"tz": "CET"}) + v11("get_time", "{}")
    out = parsed_every_way(MISTRAL_V11, text)
    assert out.content == "Checking both. "
    assert out.complete == [("get_weather", WEATHER), ("get_time", {"tz": "CET"}), ("get_time", {})]
    assert all(len(call[0]) == 9 and call[0].isalnum() for call in out.calls.values())
    assert len({call[0] for call in out.calls.values()}) == 3
    parser = MISTRAL_V11.parser(NAMES)  # the exact pieces, cut where a detokenizer could cut
    assert parser.feed("[TOOL_CALLS]get_wea") == []
    [start] = parser.feed("ther[ARGS]")
    assert isinstance(start, CallStart) and (start.index, start.name) == (0, "get_weather")
    assert parser.feed('{"city": "Pa') == [CallArguments(0, '{"city": "Pa')]
    assert parser.feed('ris"}[TOOL_CALLS]get_time') == [CallArguments(0, 'ris"}'), CallDone(0)]
    [start, arguments, done] = parser.feed("[ARGS]{}")
    assert (start.index, start.name, arguments, done) == (1, "get_time", CallArguments(1, "{}"), CallDone(1))
    assert parser.finish() == []
    assert parse(MISTRAL_V11, text, 1).argument_pieces > 10


def test_mistral_v11_text_after_calls_is_content_and_without_the_marker_the_brace_ends_the_name():
    assert parsed_every_way(MISTRAL_V11, v11("get_time", {}) + "\n\n").content == ""
    out = parsed_every_way(MISTRAL_V11, v11("get_time", {}) + " Done.")
    assert out.complete == [("get_time", {})] and out.content == " Done."
    assert parsed_every_way(MISTRAL_V11, '[TOOL_CALLS]get_time{"tz": "UTC"}').complete == [("get_time", {"tz": "UTC"})]
    first_only = parsed_every_way(MISTRAL_V11, v11("get_time", {}) + v11("get_weather", {}), max_calls=1)
    assert first_only.complete == [("get_time", {})] and first_only.content == ""


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',  # half a call (max_tokens)
        "[TOOL_CALLS]rm_rf[ARGS]{}",  # not one of the tools
        "[TOOL_CALLS]get_time[ARG]{}",  # a broken marker
        "[TOOL_CALLS]get_time[ARGS][1]",  # arguments not an object
        '[TOOL_CALLS]get_time[ARGS]{"a": 01}',  # a number JSON does not allow
        "[TOOL_CALLS]get time[ARGS]{}",  # not a name
        "[TOOL_CALLS][ARGS]{}",  # no name
        "[TOOL_CALLS]" + "f" * 65 + "[ARGS]{}",  # a name longer than any tool's
        "[TOOL_CALLS]get_time",
        "[TOOL_CALLS]",
        "[TOOL_CA",
    ],
)
def test_mistral_v11_text_that_is_not_a_whole_call_comes_back_as_content(text):
    out = parsed_every_way(MISTRAL_V11, "Hi. " + text)
    assert out.complete == [] and out.content == "Hi. " + text
    assert all(not done for *_, done in out.calls.values())


def test_mistral_v11_a_broken_call_after_a_whole_one_keeps_the_whole_one():
    out = parsed_every_way(MISTRAL_V11, v11("get_time", {}) + '[TOOL_CALLS]get_weather[ARGS]{"city": "P')
    assert out.complete == [("get_time", {})]
    assert out.content == '[TOOL_CALLS]get_weather[ARGS]{"city": "P'


def test_llama_json_calls_are_the_whole_output():
    text = ' {"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + '}; {"name": "get_time", "parameters": {}}'
    out = parsed_every_way(LLAMA3_JSON, text)
    assert out.complete == [("get_weather", WEATHER), ("get_time", {})] and out.content == ""
    typed = parsed_every_way(LLAMA3_JSON, '{"type": "function", "name": "get_time", "parameters": {"tz": "UTC"}}')
    assert typed.complete == [("get_time", {"tz": "UTC"})]
    assert parsed_every_way(LLAMA3_JSON, '{"name": "get_time"}').complete == [("get_time", {})]
    for text in ('{"answer": 42}', 'The answer: {"name": "get_time"}', '{"name": "get_time", "parameters": {'):
        out = parsed_every_way(LLAMA3_JSON, text)
        assert out.complete == [] and out.content == text


def test_formats_are_chosen_by_the_template():
    assert format_for_template(QWEN3) is HERMES
    assert format_for_template(LLAMA31) is LLAMA3_JSON
    assert format_for_template(MISTRAL_TEMPLATE) is MISTRAL
    assert format_for_template(MISTRAL_V11_TEMPLATE) is MISTRAL_V11
    assert format_for_template(R1) is None and format_for_template(None) is None


def test_mistral_history_ids_are_nine_letters_and_digits():
    assert history_id("call_abcDEF0123456789xyz") == "456789xyz"
    assert history_id("a-b") == "0000000ab"
    assert history_id("Ab3dE6gH9") == "Ab3dE6gH9"


# --- the JSON scanner -------------------------------------------------------------------------------------------


def roles(text: str) -> str:
    scanner, marked = JsonScanner(), ""
    for ch in text:
        marked += ch if scanner.push(ch) == "arguments" else "_"
    assert scanner.done
    return marked


def test_the_scanner_marks_exactly_the_arguments_value():
    assert roles('{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}') == "_" * 27 + '{"a": [1, {"b": "}"}]}' + "_"
    assert roles('{"arguments": 12, "name": "f"}') == "_" * 14 + "12" + "_" * 14
    assert roles('{"arguments":true}') == "_" * 13 + "true_"


@pytest.mark.parametrize("bad", ['{"a": tru', "{'a': 1}", '{"a" 1}', '{"a": 1,}', "[1 2]", '{"a": -}', "}"])
def test_the_scanner_stops_at_the_first_impossible_character(bad):
    scanner = JsonScanner()
    with pytest.raises(JsonSyntaxError):
        for ch in bad + "}":
            scanner.push(ch)


# --- reasoning --------------------------------------------------------------------------------------------------


def split(start: Start, text: str, size: int) -> tuple[str, str, int]:
    splitter, reasoning, content = ReasoningSplitter(start), "", ""
    for i in range(0, len(text), size):
        part = splitter.feed(text[i : i + size], num_tokens=1)
        reasoning, content = reasoning + part.reasoning, content + part.content
    last = splitter.finish()
    return reasoning + last.reasoning, content + last.content, splitter.reasoning_tokens


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_thinking_at_the_start_is_reasoning_and_its_pieces_are_counted(size):
    text = "<think>\nThe user wants x.</think>\n\nIt is 4."
    reasoning, content, tokens = split(Start.MAY_THINK, text, size)
    assert (reasoning, content) == ("\nThe user wants x.", "It is 4.")
    pieces = -(-len(text) // size)
    closing_piece = text.index("</think>") // size
    assert tokens == min(pieces, (text.index("</think>") + len("</think>") - 1) // size + 1)
    assert tokens >= closing_piece + 1
    assert split(Start.MAY_THINK, "Just an answer <think> no", size)[:2] == ("", "Just an answer <think> no")
    assert split(Start.THINKING, "still thinking</think>done", size)[:2] == ("still thinking", "done")
    assert split(Start.THINKING, "cut off mid-thou", size) == (
        "cut off mid-thou",
        "",
        pieces_of("cut off mid-thou", size),
    )
    assert split(Start.ANSWERING, "<think>x</think>y", size) == ("", "<think>x</think>y", 0)
    assert split(Start.MAY_THINK, "<thi", size)[:2] == ("", "<thi")


def pieces_of(text: str, size: int) -> int:
    return -(-len(text) // size)


def test_where_the_output_starts_is_read_from_the_prompt():
    assert start_from_prompt("<|im_start|>assistant\n") is Start.MAY_THINK
    assert start_from_prompt("<|im_start|>assistant\n<think>\n") is Start.THINKING
    assert start_from_prompt("assistant\n<think>\n\n</think>\n\n") is Start.ANSWERING


def test_a_thinking_model_calling_a_tool_as_one_choice():
    text = '<think>I need the weather.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for size in CHUNK_SIZES:
        output = ChatOutput(ReasoningSplitter(Start.MAY_THINK), HERMES.parser(NAMES))
        reasoning, content, calls = "", "", {}
        for i in range(0, len(text), size):
            delta = output.feed(text[i : i + size], num_tokens=1)
            reasoning, content = reasoning + delta.reasoning, content + delta.content
            for call in delta.tool_calls:
                calls.setdefault(call.index, [call.name, ""])[1] += call.arguments
        last = output.finish()
        assert not last.tool_calls and last.content == ""
        assert (reasoning, content) == ("I need the weather.", "")
        assert calls == {0: ["get_weather", '{"city": "Oslo"}']}
        assert [(c.name, c.arguments) for c in output.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
        assert output.content == "" and output.reasoning_text == reasoning
        assert 0 < output.reasoning_tokens <= pieces_of(text, size)
        if size == 1:  # a token per character: the thinking's, tags included
            assert output.reasoning_tokens == len("<think>I need the weather.</think>")
