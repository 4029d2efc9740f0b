"""A tool conversation rendered by each checkpoint's own template, as the replica and the gateway both render it:
the tools in the prompt, an assistant's calls with their arguments as a mapping (templates `tojson` them), the tool
results under their call's id (Mistral's templates take only 9-character ids), and chat_template_kwargs."""

from __future__ import annotations

import pytest

from tokenfleet.api.protocol import ChatCompletionRequest
from tokenfleet.model.tokenizer import Tokenizer

from .conftest import TOOLS

CALL_ID = "call_abcdefghijklmnopqrstuvwx"
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny"},
]


def rendered(model_dir, **fields) -> str:
    tokenizer = Tokenizer.from_dir(model_dir)
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": CONVERSATION, "tools": TOOLS, **fields})
    return tokenizer.decode(req.render_chat(tokenizer), skip_special_tokens=False)


def test_qwen3_renders_tools_calls_and_results(template_models):
    prompt = rendered(template_models["qwen3"])
    assert "<tools>\n" + '{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert rendered(template_models["qwen3"], chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_llama_renders_arguments_as_json_not_as_a_string(template_models):
    prompt = rendered(template_models["llama3"])
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>" in prompt
    assert '"name": "plan_trip"' in prompt  # the tools, in the first user message


def test_mistral_gets_ids_it_accepts(template_models):
    prompt = rendered(template_models["mistral"])
    assert '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "pqrstuvwx"}]' in prompt
    assert '[TOOL_RESULTS] {"content": sunny, "call_id": "pqrstuvwx"}[/TOOL_RESULTS]' in prompt


def test_mistral_v11_renders_calls_as_name_and_arguments(template_models):
    prompt = rendered(template_models["mistral_v11"])
    assert '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}<|end_of_text|>[TOOL_RESULTS]sunny[/TOOL_RESULTS]' in prompt
    assert '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"' in prompt


def test_an_assistants_reasoning_goes_back_to_templates_that_keep_it(template_models):
    thought = {**CONVERSATION[1], "reasoning_content": "Paris is in France."}
    tokenizer = Tokenizer.from_dir(template_models["qwen3"])
    body = {"model": "m", "messages": [CONVERSATION[0], thought], "add_generation_prompt": False}
    prompt = tokenizer.decode(ChatCompletionRequest.model_validate(body).render_chat(tokenizer), False)
    assert "<think>\nParis is in France.\n</think>\n\n<tool_call>" in prompt


@pytest.mark.parametrize("variable", ["messages", "tools", "add_generation_prompt"])
def test_chat_template_kwargs_cannot_replace_what_the_request_says(variable):
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": CONVERSATION[:1], "chat_template_kwargs": {variable: 1}}
        )
